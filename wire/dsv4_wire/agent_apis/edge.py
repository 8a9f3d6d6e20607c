"""What the engine's and the router's routes share: a raw agent-API request turned into a chat
body (`responses_call`, `messages_call`), and the chat path's answer turned back (`AgentCall`'s
`answer` for a JSON answer or an error, `events` for a stream). Stored responses are kept here
too. Free of any HTTP framework: bytes and dicts in, bytes out."""

from __future__ import annotations

import json
from typing import AsyncIterator, Optional, Union

from dsv4_wire.agent_apis.messages_output import MessagesStream, error_body, error_from_openai, message_from_chat
from dsv4_wire.agent_apis.messages_request import messages_to_chat
from dsv4_wire.agent_apis.responses_output import ResponsesStream, assistant_message, new_id, response_from_chat
from dsv4_wire.agent_apis.responses_request import ResponsesRequest, responses_to_chat
from dsv4_wire.agent_apis.sse import DONE, chat_event, named_event, split_events
from dsv4_wire.agent_apis.store import ResponseStore
from dsv4_wire.errors import APIError

RESPONSES, MESSAGES = "responses", "messages"


def _json(raw: Union[bytes, dict]):
    if isinstance(raw, dict):  # read and checked already (the router's body hygiene)
        return raw
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise APIError("the request body is not valid JSON") from None


def refusal(api: str, e: APIError) -> tuple[int, bytes]:
    """An error answer in the route's own shape (OpenAI's for Responses, Anthropic's for Messages)."""
    body = error_body(e.status, e.message) if api == MESSAGES else e.body()
    return e.status, json.dumps(body).encode()


class AgentCall:
    """One agent-API request on its way through the chat path."""

    def __init__(
        self,
        api: str,
        chat: dict,
        stream: bool,
        req: Optional[ResponsesRequest] = None,
        store: Optional[ResponseStore] = None,
        owner: str = "",
    ):
        self.api, self.chat, self.stream = api, chat, stream
        self.req, self.store, self.owner = req, store, owner
        self.id = new_id("resp") if api == RESPONSES else new_id("msg")

    def _keep(self, response: dict) -> None:
        if self.req is not None and self.req.store and self.store is not None:
            self.store.put(response, [*self.req.messages, assistant_message(response["output"])], self.owner)

    def answer(self, status: int, content: bytes) -> tuple[int, bytes]:
        """The chat path's JSON answer (a completion or an error) as this API's."""
        if status != 200:
            if self.api == MESSAGES:
                return status, json.dumps(error_from_openai(status, content)).encode()
            return status, content
        chat = json.loads(content)
        if self.api == MESSAGES:
            return 200, json.dumps(message_from_chat(chat, self.id)).encode()
        response = response_from_chat(self.req, chat, self.id)
        self._keep(response)
        return 200, json.dumps(response).encode()

    async def events(self, chunks: AsyncIterator[Union[bytes, str]]) -> AsyncIterator[bytes]:
        """The chat path's SSE stream as this API's named events. Closing this closes `chunks`."""
        if self.api == MESSAGES:
            t: Union[ResponsesStream, MessagesStream] = MessagesStream(self.id, self.chat.get("model") or "")
        else:
            t = ResponsesStream(self.req, self.id)

        def failed(status: int, message: str, code: Optional[str] = None) -> bytes:
            evs = t.error(status, message) if isinstance(t, MessagesStream) else t.error(message, code)
            return b"".join(named_event(e) for e in evs)

        buf = b""
        try:
            async for chunk in chunks:
                buf += chunk.encode() if isinstance(chunk, str) else chunk
                whole, buf = split_events(buf)
                for event in whole:
                    data = chat_event(event)
                    if data is None:
                        continue
                    if data == DONE:
                        out = b"".join(named_event(e) for e in t.finish())
                        if isinstance(t, ResponsesStream):
                            self._keep(t.final)
                        yield out
                        return
                    if isinstance(data.get("error"), dict):
                        err = data["error"]
                        code = err.get("code")
                        status = code if isinstance(code, int) else 500
                        message = str(err.get("message") or "the request failed")
                        yield failed(status, message, None if code is None else str(code))
                        return
                    out = b"".join(named_event(e) for e in t.feed(data))
                    if out:
                        yield out
            yield failed(502, "the answer's stream ended before it finished")
        finally:
            close = getattr(chunks, "aclose", None)
            if close is not None:
                await close()


def responses_call(raw: Union[bytes, dict], store: ResponseStore, owner: str = "") -> AgentCall:
    """A Responses request, with the conversation of its `previous_response_id`; `owner`: the
    caller's API key name (stored responses are per key)."""
    body = _json(raw)
    history = None
    prev = body.get("previous_response_id") if isinstance(body, dict) else None
    if prev is not None:
        found = store.get(prev, owner) if isinstance(prev, str) else None
        if found is None:
            raise APIError(
                f"Previous response with id '{prev}' not found (responses are kept in this server's memory "
                "while there is room, and only with store true).",
                400,
                param="previous_response_id",
                code="previous_response_not_found",
            )
        history = found.messages
    req = responses_to_chat(body, history)
    return AgentCall(RESPONSES, req.chat, req.stream, req, store, owner)


def messages_call(raw: Union[bytes, dict]) -> AgentCall:
    req = messages_to_chat(_json(raw))
    return AgentCall(MESSAGES, req.chat, req.stream)


def count_tokens_chat(raw: Union[bytes, dict]) -> dict:
    """The chat body whose prompt a `/v1/messages/count_tokens` request counts: the same
    translation as `/v1/messages`, so the count is the real request's prompt."""
    return messages_to_chat(_json(raw), counting=True).chat


def counted(tokens: int) -> bytes:
    return json.dumps({"input_tokens": tokens}).encode()


def stored(store: ResponseStore, rid: str, owner: str = "", delete: bool = False) -> tuple[int, bytes]:
    """GET (or DELETE) /v1/responses/{rid}, for the caller's API key name `owner`."""
    found = store.get(rid, owner)
    if found is None:
        return refusal(
            RESPONSES, APIError(f"Response with id '{rid}' not found.", 404, param="response_id", code="not_found")
        )
    if delete:
        store.delete(rid, owner)
        return 200, json.dumps({"id": rid, "object": "response.deleted", "deleted": True}).encode()
    return 200, json.dumps(found.response).encode()
