"""A chat completion (or its stream) as a Responses API answer. Pure.

Output items in the order the model produced them: `reasoning` (its text as `reasoning_text`
content: the model's own reasoning, not a summary), `message` (`output_text`), `function_call`
(one per call, `call_id` the chat call's id). A finish by `max_tokens` is status `incomplete`
with `incomplete_details.reason: "max_output_tokens"`.

Streamed, the events follow OpenAI's sequence: `response.created`, `response.in_progress`, per
item `response.output_item.added`, its content (`response.content_part.added`,
`response.output_text.delta` / `response.reasoning_text.delta` ..., `.done`,
`response.content_part.done`; a call's `response.function_call_arguments.delta` ... `.done`),
`response.output_item.done`, and last `response.completed` (or `response.incomplete`) with the
whole response; an error is an `error` event, then `response.failed`.
"""

from __future__ import annotations

import time
import uuid
from typing import Optional

from dsv4_wire.agent_apis.chat_stream import ChatChunkFolder

from dsv4_wire.agent_apis.responses_request import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(chat_usage: Optional[dict]) -> Optional[dict]:
    if not chat_usage:
        return None
    details = chat_usage.get("completion_tokens_details") or {}
    return {
        "input_tokens": chat_usage.get("prompt_tokens", 0),
        "input_tokens_details": {
            "cached_tokens": (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        },
        "output_tokens": chat_usage.get("completion_tokens", 0),
        "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens") or 0},
        "total_tokens": chat_usage.get("total_tokens", 0),
    }


def envelope(req: ResponsesRequest, rid: str, created: int, model: str) -> dict:
    """The response object around its output, as the request set it up (status in progress)."""
    b = req.body
    text = b.get("text") if isinstance(b.get("text"), dict) else {}
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": b.get("instructions"),
        "max_output_tokens": b.get("max_output_tokens"),
        "model": model,
        "output": [],
        "parallel_tool_calls": b.get("parallel_tool_calls") is not False,
        "previous_response_id": b.get("previous_response_id"),
        "reasoning": {"effort": (b.get("reasoning") or {}).get("effort"), "summary": None},
        "store": req.store,
        "temperature": b.get("temperature"),
        "text": {"format": text.get("format") or {"type": "text"}},
        "tool_choice": b.get("tool_choice") or "auto",
        "tools": b.get("tools") or [],
        "top_p": b.get("top_p"),
        "truncation": "disabled",
        "usage": None,
        "user": b.get("user"),
        "metadata": b.get("metadata") or {},
    }


def _finished(resp: dict, output: list, finish_reason: Optional[str], usage: Optional[dict]) -> dict:
    incomplete = finish_reason == "length"
    return dict(
        resp,
        status="incomplete" if incomplete else "completed",
        incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
        output=output,
        usage=_usage(usage),
    )


def reasoning_item(text: str, status: str = "completed") -> dict:
    return {
        "id": new_id("rs"),
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def message_item(text: str, status: str = "completed") -> dict:
    return {
        "id": new_id("msg"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "id": new_id("fc"),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def assistant_message(output: list) -> dict:
    """The answer as the chat message a later round (previous_response_id) re-renders."""
    msg: dict = {"role": "assistant", "content": None}
    for item in output:
        if item["type"] == "reasoning":
            msg["reasoning_content"] = "".join(c["text"] for c in item["content"])
        elif item["type"] == "message":
            msg["content"] = (msg["content"] or "") + "".join(c["text"] for c in item["content"])
        else:
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            msg.setdefault("tool_calls", []).append(call)
    return msg


def response_from_chat(req: ResponsesRequest, chat: dict, rid: str) -> dict:
    """The Responses answer of a (non-streamed) chat completion."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    output = []
    if message.get("reasoning_content"):
        output.append(reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        output.append(message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        output.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    resp = envelope(req, rid, int(chat.get("created") or time.time()), chat.get("model") or "")
    return _finished(resp, output, choice.get("finish_reason"), chat.get("usage"))


class ResponsesStream(ChatChunkFolder):
    """Chat stream chunks in, Responses events out (dicts; `sse.named_event` writes them)."""

    REASONING, TEXT = "reasoning", "message"

    def __init__(self, req: ResponsesRequest, rid: str):
        self.req, self.rid = req, rid
        self.seq = 0
        self.resp: Optional[dict] = None
        self.output: list[dict] = []
        self.cur: Optional[dict] = None  # the item being produced
        self.cur_text = ""
        self.calls: dict[int, dict] = {}  # chat tool-call index -> its item
        self.finish_reason: Optional[str] = None
        self.usage: Optional[dict] = None
        self.final: Optional[dict] = None  # the completed response, once sent

    def _ev(self, kind: str, **fields) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def _start(self, model: str) -> list[dict]:
        if self.resp is not None:
            return []
        self.resp = envelope(self.req, self.rid, int(time.time()), model)
        return [self._ev("response.created", response=self.resp), self._ev("response.in_progress", response=self.resp)]

    def _index(self) -> int:
        return len(self.output)

    def _close(self) -> list[dict]:
        item, self.cur = self.cur, None
        if item is None:
            return []
        i, evs = self._index(), []
        if item["type"] == "function_call":
            evs.append(
                self._ev(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=i,
                    arguments=item["arguments"],
                    name=item["name"],
                )
            )
        else:
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            part = {"type": kind, "text": self.cur_text}
            if kind == "output_text":
                part.update(annotations=[], logprobs=[])
            extra = {"logprobs": []} if kind == "output_text" else {}
            evs.append(
                self._ev(
                    f"response.{kind}.done",
                    item_id=item["id"],
                    output_index=i,
                    content_index=0,
                    text=self.cur_text,
                    **extra,
                )
            )
            evs.append(
                self._ev("response.content_part.done", item_id=item["id"], output_index=i, content_index=0, part=part)
            )
            item["content"] = [part]
        item["status"] = "completed"
        evs.append(self._ev("response.output_item.done", output_index=i, item=item))
        self.output.append(item)
        self.cur_text = ""
        return evs

    def _open(self, item: dict) -> list[dict]:
        evs = self._close()
        self.cur, self.cur_text = item, ""
        i = self._index()
        evs.append(self._ev("response.output_item.added", output_index=i, item=dict(item)))
        if item["type"] != "function_call":
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            part = {"type": kind, "text": ""}
            if kind == "output_text":
                part.update(annotations=[], logprobs=[])
            evs.append(
                self._ev("response.content_part.added", item_id=item["id"], output_index=i, content_index=0, part=part)
            )
        return evs

    def _text(self, kind: str, text: str) -> list[dict]:
        evs = []
        if self.cur is None or self.cur["type"] != kind:
            item = reasoning_item("", "in_progress") if kind == "reasoning" else message_item("", "in_progress")
            item["content"] = []
            evs += self._open(item)
        self.cur_text += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        evs.append(
            self._ev(name, item_id=self.cur["id"], output_index=self._index(), content_index=0, delta=text, **extra)
        )
        return evs

    def _call(self, delta: dict) -> list[dict]:
        evs = []
        idx = delta.get("index", 0)
        fn = delta.get("function") or {}
        item = self.calls.get(idx)
        if item is None:
            item = self.calls[idx] = call_item(
                delta.get("id") or new_id("call"), fn.get("name") or "", "", "in_progress"
            )
            evs += self._open(item)
        elif item is not self.cur:
            return evs  # a call is streamed whole before the next starts: a late fragment has no item left
        args = fn.get("arguments") or ""
        if args:
            item["arguments"] += args
            evs.append(
                self._ev(
                    "response.function_call_arguments.delta", item_id=item["id"], output_index=self._index(), delta=args
                )
            )
        return evs

    def finish(self) -> list[dict]:
        """The closing events, once the chat stream said [DONE]."""
        evs = self._start(self.req.body.get("model") or "") + self._close()
        self.final = _finished(self.resp, self.output, self.finish_reason, self.usage)
        kind = "response.incomplete" if self.final["status"] == "incomplete" else "response.completed"
        return evs + [self._ev(kind, response=self.final)]

    def error(self, message: str, code: Optional[str] = None) -> list[dict]:
        evs = self._start(self.req.body.get("model") or "")
        evs.append(self._ev("error", code=code, message=message, param=None))
        failed = dict(
            self.resp, status="failed", output=self.output, error={"code": code or "server_error", "message": message}
        )
        return evs + [self._ev("response.failed", response=failed)]
