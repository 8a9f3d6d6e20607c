"""One choice's generated text -> the assistant message (or streamed deltas): reasoning first,
then tool calls inside the answer, then plain content."""

from __future__ import annotations

from typing import Optional, Sequence

from dsv4_serve.chat.reasoning import ReasoningStream, split_reasoning
from dsv4_serve.chat.tool_parsers import DsmlParser, ToolCallStream, ToolParser, openai_tool_calls


class ChatOutput:
    """`tool_parser`: parse calls (the request has tools); `reasoning`: None when no reasoning
    parser runs, else whether the output starts inside reasoning; `parallel`: False keeps only
    the first call (`parallel_tool_calls: false`, as vLLM)."""

    def __init__(self, tool_parser: Optional[ToolParser], reasoning: Optional[bool], parallel: bool = True):
        self.tool_parser = tool_parser
        self.reasoning = reasoning
        self.max_calls = None if parallel else 1
        # DSML: the block's start marker ends reasoning left open (DeepSeek's V4 parsers do too)
        self._ends_at = (tool_parser.start,) if isinstance(tool_parser, DsmlParser) else ()
        self._rs = ReasoningStream(reasoning, self._ends_at) if reasoning is not None else None
        self._ts = ToolCallStream(tool_parser) if tool_parser is not None else None
        self.has_calls = False

    def message(self, text: str) -> dict:
        """The whole message at once (non-streamed)."""
        msg: dict = {"role": "assistant"}
        content = text
        if self.reasoning is not None:
            reasoning, content, _ = split_reasoning(text, self.reasoning, False, self._ends_at)
            msg["reasoning_content"] = reasoning or None
        calls = []
        if self.tool_parser is not None:
            parsed = self.tool_parser.parse(content)
            content, calls = parsed.content, [c for c in parsed.calls if c.done][: self.max_calls]
        self.has_calls = bool(calls)
        msg["content"] = content if content or not calls else None
        if calls:
            msg["tool_calls"] = openai_tool_calls(calls)
        return msg

    def feed(self, delta: str) -> dict:
        return self._delta(*self._rs.feed(delta)) if self._rs else self._delta("", delta)

    def finish(self) -> dict:
        """What is left at the end (held-back tails; a block found malformed comes out as content)."""
        reasoning, content = self._rs.finish() if self._rs else ("", "")
        return self._delta(reasoning, content, final=True)

    def _delta(self, reasoning: str, content: str, final: bool = False) -> dict:
        out: dict = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        calls: list = []
        if self._ts is not None:
            content, calls = self._ts.feed(content)
            if final:
                more, calls2 = self._ts.finish()
                content += more
                calls += calls2
                self.has_calls = bool(self._ts.calls)
        if self.max_calls is not None:
            calls = [c for c in calls if c["index"] < self.max_calls]
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = calls
        return out


def reasoning_tokens(token_ids: Sequence[int], think_end_id: Optional[int], reasoning_text: bool) -> int:
    """Completion tokens spent reasoning: those before `</think>`, or all of them when the output
    never closed its reasoning."""
    if think_end_id is not None and think_end_id in token_ids:
        return list(token_ids).index(think_end_id)
    return len(token_ids) if reasoning_text else 0
