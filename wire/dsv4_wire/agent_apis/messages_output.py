"""A chat completion (or its stream) as an Anthropic Messages answer, and errors in Anthropic's
shape. Pure.

Content blocks in the order the model produced them: `thinking` (its `signature` empty: nothing
here signs reasoning, and a client sends it back as it came), `text`, `tool_use` (`input` the
call's arguments as an object, `id` the chat call's id). `stop_reason`: `tool_use` when the turn
ends in calls, `max_tokens`, else `end_turn` (the chat path does not say whether a stop sequence
matched, so `stop_sequence` is never reported). `usage.input_tokens` counts the prompt tokens the
prefix cache did not serve, `cache_read_input_tokens` those it did.

Streamed: `message_start`, per block `content_block_start`, `content_block_delta`s
(`thinking_delta`, `text_delta`, `input_json_delta`), `content_block_stop`, then `message_delta`
(stop reason and usage) and `message_stop`; an error is an `error` event.
"""

from __future__ import annotations

import json
from typing import Optional

from dsv4_wire.agent_apis.chat_stream import ChatChunkFolder

from dsv4_wire.agent_apis.responses_output import new_id

STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(status: int, message: str) -> dict:
    """Anthropic's error body for an HTTP status."""
    kind = ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_from_openai(status: int, content: bytes) -> dict:
    """An OpenAI-shaped error answer (what the chat path and the gates say) in Anthropic's shape."""
    try:
        message = json.loads(content)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = content.decode("utf-8", "replace") or f"HTTP {status}"
    return error_body(status, message)


def _usage(chat_usage: Optional[dict]) -> dict:
    u = chat_usage or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": u.get("prompt_tokens", 0) - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": u.get("completion_tokens", 0),
    }


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message_from_chat(chat: dict, mid: str) -> dict:
    choice = (chat.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    content: list[dict] = []
    if msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or []:
        fn = call["function"]
        content.append({"type": "tool_use", "id": call["id"], "name": fn["name"], "input": _input(fn["arguments"])})
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": chat.get("model") or "",
        "content": content,
        "stop_reason": STOP_REASONS.get(choice.get("finish_reason"), "end_turn"),
        "stop_sequence": None,
        "usage": _usage(chat.get("usage")),
    }


class MessagesStream(ChatChunkFolder):
    """Chat stream chunks in, Messages events out (dicts; `sse.named_event` writes them)."""

    REASONING, TEXT = "thinking", "text"

    def __init__(self, mid: str, model: str):
        self.mid, self.model = mid, model
        self.started = False
        self.index = -1  # the open block's index
        self.kind: Optional[str] = None  # the open block's type
        self.calls: dict[int, int] = {}  # chat tool-call index -> block index
        self.finish_reason: Optional[str] = None
        self.usage: Optional[dict] = None

    def _start(self, model: str) -> list[dict]:
        if self.started:
            return []
        self.started = True
        message = {
            "id": self.mid,
            "type": "message",
            "role": "assistant",
            "model": model or self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(None),
        }
        return [{"type": "message_start", "message": message}]

    def _close(self) -> list[dict]:
        if self.kind is None:
            return []
        self.kind = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _open(self, block: dict) -> list[dict]:
        evs = self._close()
        self.index += 1
        self.kind = block["type"]
        return evs + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _text(self, kind: str, text: str) -> list[dict]:
        evs = []
        if self.kind != kind:
            evs += self._open(
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": "text", "text": ""}
            )
        delta = (
            {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta", "text": text}
        )
        return evs + [{"type": "content_block_delta", "index": self.index, "delta": delta}]

    def _call(self, delta: dict) -> list[dict]:
        evs = []
        idx = delta.get("index", 0)
        fn = delta.get("function") or {}
        if idx not in self.calls:
            evs += self._open(
                {
                    "type": "tool_use",
                    "id": delta.get("id") or new_id("toolu"),
                    "name": fn.get("name") or "",
                    "input": {},
                }
            )
            self.calls[idx] = self.index
        elif self.calls[idx] != self.index or self.kind != "tool_use":
            return evs  # its block is closed: a call is streamed whole before the next starts
        if fn.get("arguments"):
            evs.append(
                {
                    "type": "content_block_delta",
                    "index": self.index,
                    "delta": {"type": "input_json_delta", "partial_json": fn["arguments"]},
                }
            )
        return evs

    def finish(self) -> list[dict]:
        evs = self._start("") + self._close()
        delta = {"stop_reason": STOP_REASONS.get(self.finish_reason or "stop", "end_turn"), "stop_sequence": None}
        evs.append({"type": "message_delta", "delta": delta, "usage": _usage(self.usage)})
        return evs + [{"type": "message_stop"}]

    def error(self, status: int, message: str) -> list[dict]:
        return [error_body(status, message)]
