"""Reasoning text (`<think>` ... `</think>`) apart from the answer, as DeepSeek's models write it.

DeepSeek-R1 always thinks (its template opens `<think>`); V3.1, V3.2 and V4 think when the prompt
opened `<think>` (thinking mode on) — then the output is reasoning up to `</think>`, the answer
after it. A leading `<think>` in the output opens reasoning too. Without `</think>` all of it is
reasoning (the model ran out of tokens while thinking).
"""

from __future__ import annotations

from dsv4_wire import chat_tokens as T
from dsv4_serve.chat.tool_parsers import _partial_marker_tail


def split_reasoning(
    text: str, in_reasoning: bool, partial: bool = False, ends_at: tuple[str, ...] = ()
) -> tuple[str, str, bool]:
    """(reasoning, content, reasoning ended). Streaming holds back a tail that may become a marker.
    `ends_at`: markers that end reasoning that never closed with `</think>`, the content starting
    at the marker (V4's tool-call block: a call the model wrote without closing its reasoning is
    still a call)."""
    body = text
    stripped = body.lstrip()
    if stripped.startswith(T.THINK_START):
        body, in_reasoning = stripped[len(T.THINK_START) :], True
    elif partial and T.THINK_START.startswith(stripped):
        return "", "", False  # blanks or a split `<think>`: may still open reasoning
    if not in_reasoning:
        return "", body, False
    j = body.find(T.THINK_END)
    ends = [(k, m) for m in ends_at if (k := body.find(m)) >= 0 and (j < 0 or k < j)]
    if ends:
        k = min(ends)[0]
        return body[:k], body[k:], True
    if j < 0:
        if partial:
            body = body[: len(body) - max(_partial_marker_tail(body, m) for m in (T.THINK_END, *ends_at))]
        return body, "", False
    return body[:j], body[j + len(T.THINK_END) :], True


class ReasoningStream:
    """Feed text deltas; get (reasoning delta, content delta) back; the joined pieces equal
    split_reasoning(whole text)."""

    def __init__(self, in_reasoning: bool, ends_at: tuple[str, ...] = ()):
        self.in_reasoning, self.ends_at = in_reasoning, ends_at
        self.text = ""
        self.sent = ["", ""]

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        return self._emit(*split_reasoning(self.text, self.in_reasoning, True, self.ends_at)[:2])

    def finish(self) -> tuple[str, str]:
        return self._emit(*split_reasoning(self.text, self.in_reasoning, False, self.ends_at)[:2])

    def _emit(self, reasoning: str, content: str) -> tuple[str, str]:
        out = []
        for k, now in enumerate((reasoning, content)):
            if now.startswith(self.sent[k]):
                out.append(now[len(self.sent[k]) :])
                self.sent[k] = now
            else:
                out.append("")
        return out[0], out[1]
