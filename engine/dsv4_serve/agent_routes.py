"""The engine's routes of the agent harnesses' APIs: OpenAI's Responses (`/v1/responses`, and
GET/DELETE of a stored response) and Anthropic's Messages (`/v1/messages`, and
`/v1/messages/count_tokens`: the prompt that request would have, counted), each translated onto
the chat-completions path (`dsv4_wire.agent_apis`): same validation, renderers, parsers and
grammars as `/v1/chat/completions`."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from dsv4_serve.serving import OpenAIServing, internal_error
from dsv4_wire import APIError, Paths
from dsv4_wire.agent_apis.edge import (
    MESSAGES,
    RESPONSES,
    AgentCall,
    count_tokens_chat,
    counted,
    messages_call,
    refusal,
    responses_call,
    stored,
)
from dsv4_wire.agent_apis.store import ResponseStore
from dsv4_wire.api_keys import caller_name

log = logging.getLogger("dsv4.server")


def owner(http: Request) -> str:
    return caller_name(http.scope)


def _json(status: int, content: bytes) -> Response:
    return Response(content, status, media_type="application/json")


def add_agent_routes(app: FastAPI, serving: OpenAIServing) -> None:
    store = ResponseStore()
    app.state.responses = store

    async def serve(api: str, http: Request) -> Response:
        try:
            raw = await http.body()
            call: AgentCall = responses_call(raw, store, owner(http)) if api == RESPONSES else messages_call(raw)
            answer = await serving.serve(serving.prepare_chat, http, json.dumps(call.chat).encode())
        except APIError as e:
            return _json(*refusal(api, e))
        except Exception:  # a bug: logged with a reference, answered in the route's shape
            ref = uuid.uuid4().hex[:12]
            log.exception("%s failed (reference %s)", http.url.path, ref)
            return _json(*refusal(api, internal_error(ref)))
        if isinstance(answer, StreamingResponse):
            return StreamingResponse(call.events(answer.body_iterator), media_type="text/event-stream")
        if answer.status_code == 499:  # the client left
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
        try:
            chat = count_tokens_chat(await http.body())
            # rendering and tokenising a long conversation is CPU work: off the event loop
            tokens = await asyncio.to_thread(serving.count_chat_tokens, json.dumps(chat).encode())
        except APIError as e:
            return _json(*refusal(MESSAGES, e))
        return _json(200, counted(tokens))
