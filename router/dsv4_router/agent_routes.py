"""The router's routes of the agent harnesses' APIs: OpenAI's Responses (`/v1/responses`, and
GET/DELETE of a stored response, kept in this router's memory) and Anthropic's Messages
(`/v1/messages`; `/v1/messages/count_tokens` is counted by an engine, which renders the prompt
with the checkpoint's format). Each request is read with the same body hygiene, translated to a chat
completion (`dsv4_wire.agent_apis`) and handled as one, with the same admission, tenancy,
placement, PD pairing and migration; the answer or the relayed stream is translated back."""

from __future__ import annotations

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from dsv4_router.body import parse_body, read_limited
from dsv4_router.relay import RelayResponse
from dsv4_router.router import Router
from dsv4_wire import APIError, Paths
from dsv4_wire.agent_apis.edge import (
    MESSAGES,
    RESPONSES,
    AgentCall,
    count_tokens_chat,
    messages_call,
    refusal,
    responses_call,
    stored,
)
from dsv4_wire.agent_apis.store import ResponseStore
from dsv4_wire.api_keys import caller_name


def owner(http: Request) -> str:
    return caller_name(http.scope)


def _json(status: int, content: bytes) -> Response:
    return Response(content, status, media_type="application/json")


def add_agent_routes(app: FastAPI, router: Router) -> None:
    store = ResponseStore()
    app.state.responses = store

    async def serve(api: str, http: Request) -> Response:
        try:
            raw = await read_limited(http.headers.get("content-length"), http.stream(), router.body_limit())
            call: AgentCall = (
                responses_call(parse_body(raw), store, owner(http))
                if api == RESPONSES
                else messages_call(parse_body(raw))
            )
        except APIError as e:
            router.metrics.errors.labels(str(e.status)).inc()
            return _json(*refusal(api, e))
        except ClientDisconnect:
            return Response(status_code=499)
        answer = await router.handle(Paths.CHAT_COMPLETIONS, http, call.chat)
        if isinstance(answer, RelayResponse):
            answer.translate(call.events)  # closing it closes the relay
            return answer
        if answer.status_code == 499:
            return answer
        return _json(*call.answer(answer.status_code, bytes(answer.body)))

    @app.post(Paths.RESPONSES)
    async def responses(http: Request):
        return await serve(RESPONSES, http)

    @app.get(Paths.RESPONSES + "/{rid}")
    async def get_response(rid: str, http: Request):
        return _json(*stored(store, rid, owner(http)))

    @app.delete(Paths.RESPONSES + "/{rid}")
    async def delete_response(rid: str, http: Request):
        return _json(*stored(store, rid, owner(http), delete=True))

    @app.post(Paths.MESSAGES)
    async def messages(http: Request):
        return await serve(MESSAGES, http)

    @app.post(Paths.MESSAGES_COUNT_TOKENS)
    async def count_tokens(http: Request):
        router.metrics.requests.labels(Paths.MESSAGES_COUNT_TOKENS).inc()
        try:
            raw = await read_limited(http.headers.get("content-length"), http.stream(), router.body_limit())
            body = parse_body(raw)
            count_tokens_chat(body)  # what cannot be translated is refused here, in Anthropic's shape
        except APIError as e:
            router.metrics.errors.labels(str(e.status)).inc()
            return _json(*refusal(MESSAGES, e))
        except ClientDisconnect:
            return Response(status_code=499)
        # every engine renders alike: any healthy one counts (decode last: it is the busiest)
        order = {"mono": 0, "prefill": 1, "decode": 2}
        for w in sorted((w for w in router.pool.workers.values() if w.healthy), key=lambda w: order.get(w.role, 3)):
            try:
                r = await router.up.prefill.post(w.url + Paths.MESSAGES_COUNT_TOKENS, json=body)
            except httpx.HTTPError:
                continue
            if r.status_code < 500:
                return _json(r.status_code, r.content)
        e = APIError("no healthy engine is available", 503, "service_unavailable")
        router.metrics.errors.labels("503").inc()
        return _json(*refusal(MESSAGES, e))
