"""Reasoning text (`<think>` ... `</think>`) apart from the answer, as DeepSeek's models write it.

DeepSeek-R1 always thinks (its template opens `<think>`); V3.1, V3.2 and V4 think when the prompt
opened `<think>` (thinking mode on) — then the output is reasoning up to `</think>`, the answer
after it. A leading `<think>` in the output opens reasoning too. Without `</think>` all of it is
reasoning (the model ran out of tokens while thinking).
"""

from __future__ import annotations

from dsv4_wire import chat_tokens as T
from dsv4_serve.chat.tool_parsers import _partial_marker_tail


def split_reasoning(text: str, in_reasoning: bool, partial: bool = False) -> tuple[str, str, bool]:
    """(reasoning, content, reasoning ended). Streaming holds back a tail that may become a marker."""
    body = text
    stripped = body.lstrip()
    if stripped.startswith(T.THINK_START):
        body, in_reasoning = stripped[len(T.THINK_START) :], True
    elif partial and not in_reasoning and T.THINK_START.startswith(stripped):
        return "", "", False  # may still become <think>
    if not in_reasoning:
        return "", body, False
    j = body.find(T.THINK_END)
    if j < 0:
        if partial:
            body = body[: len(body) - _partial_marker_tail(body, T.THINK_END)]
        return body, "", False
    return body[:j], body[j + len(T.THINK_END) :], True


class ReasoningStream:
    """Feed text deltas; get (reasoning delta, content delta) back; the joined pieces equal
    split_reasoning(whole text)."""

    def __init__(self, in_reasoning: bool):
        self.in_reasoning = in_reasoning
        self.text = ""
        self.sent = ["", ""]

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        return self._emit(*split_reasoning(self.text, self.in_reasoning, partial=True)[:2])

    def finish(self) -> tuple[str, str]:
        return self._emit(*split_reasoning(self.text, self.in_reasoning)[:2])

    def _emit(self, reasoning: str, content: str) -> tuple[str, str]:
        out = []
        for k, now in enumerate((reasoning, content)):
            if now.startswith(self.sent[k]):
                out.append(now[len(self.sent[k]) :])
                self.sent[k] = now
            else:
                out.append("")
        return out[0], out[1]
