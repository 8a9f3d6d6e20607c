"""What the agent APIs' streams share: each folds the chat path's stream chunks into its own
events, reasoning and text into its two block kinds and tool-call deltas into calls."""

from __future__ import annotations

from typing import Optional


class ChatChunkFolder:
    REASONING: str  # the API's block kind for reasoning
    TEXT: str  # and for the answer's text
    usage: Optional[dict] = None
    finish_reason: Optional[str] = None

    def _start(self, model: str) -> list[dict]:
        raise NotImplementedError

    def _text(self, kind: str, text: str) -> list[dict]:
        raise NotImplementedError

    def _call(self, delta: dict) -> list[dict]:
        raise NotImplementedError

    def feed(self, chunk: dict) -> list[dict]:
        """The events of one chat chunk."""
        evs = self._start(chunk.get("model") or "")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                evs += self._text(self.REASONING, delta["reasoning_content"])
            if delta.get("content"):
                evs += self._text(self.TEXT, delta["content"])
            for call in delta.get("tool_calls") or []:
                evs += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return evs
