"""Model output text -> OpenAI tool calls, for DeepSeek's tool-call formats (pure functions).

Each parser reads the whole text seen so far and returns a `Parse`: the content outside the
tool-call block, and the calls (name, arguments text so far, whether the call is complete).
`partial=True` (streaming) holds back text that may still turn into a marker and leaves the
last call open; `partial=False` (the final text) is strict: a malformed block is no call at
all, and the whole text stays content — a model's bad output is never a server error.
`ToolCallStream` turns successive parses into OpenAI's streamed deltas.

Formats (facts of DeepSeek's releases):
- deepseek_v3:  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
- deepseek_v31: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
- deepseek_v32 / deepseek_v4: <｜DSML｜function_calls> (V4: tool_calls) holding
  <｜DSML｜invoke name="NAME"> <｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter> </｜DSML｜invoke>;
  string="true" values are raw text, the others JSON. Arguments become a JSON object.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from dsv4_wire import chat_tokens as T


class Malformed(Exception):
    pass


@dataclass
class Call:
    name: str
    arguments: str  # JSON text (so far, while streaming)
    done: bool = False


@dataclass
class Parse:
    content: str
    calls: list[Call] = field(default_factory=list)


def _partial_marker_tail(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class _Incomplete(Exception):
    """The text ends inside a construct (streaming: wait for more)."""


class _Cursor:
    def __init__(self, text: str, pos: int, partial: bool):
        self.text, self.pos, self.partial = text, pos, partial

    def ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t\r\n":
            self.pos += 1

    def at(self, lit: str) -> bool:
        return self.text.startswith(lit, self.pos)

    def expect(self, lit: str) -> None:
        if self.text.startswith(lit, self.pos):
            self.pos += len(lit)
            return
        rest = self.text[self.pos :]
        if self.partial and lit.startswith(rest):
            raise _Incomplete
        raise Malformed(f"expected {lit!r}")

    def until(self, delim: str) -> str:
        """Text up to `delim` (consumed). Streaming: _Incomplete when the delimiter is not there yet."""
        j = self.text.find(delim, self.pos)
        if j < 0:
            if self.partial:
                raise _Incomplete
            raise Malformed(f"missing {delim!r}")
        out = self.text[self.pos : j]
        self.pos = j + len(delim)
        return out

    def open_until(self, delim: str) -> tuple[str, bool]:
        """Like until(), but streaming returns what is there so far (minus a possible start of
        the delimiter) and False."""
        j = self.text.find(delim, self.pos)
        if j < 0:
            if not self.partial:
                raise Malformed(f"missing {delim!r}")
            rest = self.text[self.pos :]
            self.pos = len(self.text)
            return rest[: len(rest) - _partial_marker_tail(rest, delim)], False
        out = self.text[self.pos : j]
        self.pos = j + len(delim)
        return out, True


def _json_object(text: str) -> str:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise Malformed(f"arguments are not JSON: {e}") from None
    if not isinstance(value, dict):
        raise Malformed("arguments must be a JSON object")
    return text


class ToolParser:
    name = ""
    start = ""  # the marker that opens the tool-call block
    end = ""

    def parse(self, text: str, partial: bool = False) -> Parse:
        """Content outside the blocks and the calls inside them. A block keeps the calls that
        were complete and well formed before it went wrong or was cut off (max_tokens); its
        markup never becomes content. Text after a closed block is content (or another block)."""
        content, calls, pos = "", [], 0
        while True:
            i = text.find(self.start, pos)
            if i < 0:
                return Parse(content + self._content_before(text[pos:], partial), calls)
            content += self._content_before(text[pos:i], False, block_follows=True)
            cur = _Cursor(text, i + len(self.start), partial)
            mine: list[Call] = []
            try:
                closed = self._calls(cur, mine)
            except (_Incomplete, Malformed):
                closed = False
            calls += [c for c in mine if c.done]
            if not closed:
                return Parse(content, calls)
            pos = cur.pos

    def _content_before(self, text: str, partial: bool, block_follows: bool = False) -> str:
        return text[: len(text) - self._cut_tail(text, partial)]

    def _cut_tail(self, text: str, partial: bool) -> int:
        """How much of the end of the text to hold back (streaming: it may still become the
        block's marker) or drop (the final text: a marker cut short by max_tokens; one `<` alone
        is kept, as prose)."""
        cut = _partial_marker_tail(text, self.start)
        return cut if partial or cut >= 2 else 0

    def _calls(self, cur: _Cursor, calls: list[Call]) -> bool:
        raise NotImplementedError


class DeepSeekV31Parser(ToolParser):
    name = "deepseek_v31"
    start, end = T.TOOL_CALLS_BEGIN, T.TOOL_CALLS_END

    def _calls(self, cur: _Cursor, calls: list[Call]) -> bool:
        while True:
            cur.ws()
            if cur.at(self.end):
                cur.pos += len(self.end)
                return True
            if cur.pos >= len(cur.text):
                if cur.partial:
                    raise _Incomplete
                if calls and all(c.done for c in calls):
                    return True  # the model ended after its last call without closing the block
                raise Malformed("unterminated tool-call block")
            cur.expect(T.TOOL_CALL_BEGIN)
            self._head(cur, calls)
            args, done = cur.open_until(self._args_end)
            args = self._args(args, done)
            if done:
                args = _json_object(args)
            calls[-1].arguments, calls[-1].done = args, done
            if not done:
                raise _Incomplete

    _args_end = T.TOOL_CALL_END

    def _head(self, cur: _Cursor, calls: list[Call]) -> None:
        name = cur.until(T.TOOL_SEP).strip()
        if not name:
            raise Malformed("empty tool name")
        calls.append(Call(name, ""))

    def _args(self, args: str, done: bool) -> str:
        return args.strip()  # streamed and final alike: trailing blanks wait for what follows


class DeepSeekV3Parser(DeepSeekV31Parser):
    name = "deepseek_v3"
    _args_end = "\n```" + T.TOOL_CALL_END

    def _head(self, cur: _Cursor, calls: list[Call]) -> None:
        cur.expect("function")
        cur.expect(T.TOOL_SEP)
        name = cur.until("\n").strip()
        if not name:
            raise Malformed("empty tool name")
        cur.expect("```json\n")
        calls.append(Call(name, ""))


class DsmlParser(ToolParser):
    """DeepSeek-V3.2 (`function_calls`) and V4 (`tool_calls`) DSML blocks."""

    block = "tool_calls"

    def __init__(self) -> None:
        d = T.DSML
        self.start, self.end = f"<{d}{self.block}>", f"</{d}{self.block}>"
        self.invoke, self.invoke_end = f'<{d}invoke name="', f"</{d}invoke>"
        self.param, self.param_end = f'<{d}parameter name="', f"</{d}parameter>"

    def _content_before(self, text: str, partial: bool, block_follows: bool = False) -> str:
        if block_follows:
            return text.rstrip("\n")  # the encoder writes "\n\n" before the block
        cut = self._cut_tail(text, partial)
        if cut or partial:  # trailing newlines may still precede a block (or preceded a cut one)
            return text[: len(text) - cut].rstrip("\n")
        return text

    def _calls(self, cur: _Cursor, calls: list[Call]) -> bool:
        while True:
            cur.ws()
            if cur.at(self.end):
                cur.pos += len(self.end)
                return True
            if cur.pos >= len(cur.text) and cur.partial:
                raise _Incomplete
            cur.expect(self.invoke)
            name = cur.until('">')
            if not name or any(ch in name for ch in '"<>\n'):
                raise Malformed("bad tool name")
            call = Call(name, "{")
            calls.append(call)
            seen: set[str] = set()
            while True:
                cur.ws()
                if cur.at(self.invoke_end):
                    cur.pos += len(self.invoke_end)
                    call.arguments += "}"
                    call.done = True
                    break
                cur.expect(self.param)
                key = cur.until('" string="')
                if key in seen or not key or any(ch in key for ch in '"<>\n'):
                    raise Malformed("bad or repeated parameter name")
                if cur.at('true">'):
                    cur.pos += len('true">')
                    is_string = True
                else:
                    cur.expect('false">')
                    is_string = False
                raw = cur.until(self.param_end)
                if is_string:
                    value = raw
                else:
                    try:
                        value = json.loads(raw)
                    except ValueError:
                        value = raw  # a string the model marked string="false": kept, as the peers do
                seen.add(key)
                sep = ", " if len(seen) > 1 else ""
                call.arguments += f"{sep}{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"


class DeepSeekV32Parser(DsmlParser):
    name = "deepseek_v32"
    block = "function_calls"


class DeepSeekV4Parser(DsmlParser):
    name = "deepseek_v4"
    block = "tool_calls"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """Streamed parsing: feed text deltas, get OpenAI delta pieces back.

    Each feed re-parses everything seen (partial=True) and emits what grew: content, a call's
    `id`/`name` once its name is known, and its arguments in fragments. `finish()` parses the
    whole text strictly and emits the rest; the streamed pieces join to the non-streamed result
    for well-formed output (a block found malformed only at the end comes out as content)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.sent_content = ""
        self.sent: list[list[str]] = []  # per call: [id, arguments sent]
        self.calls: list[Call] = []

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.text += delta
        return self._emit(self.parser.parse(self.text, partial=True))

    def finish(self) -> tuple[str, list[dict]]:
        final = self.parser.parse(self.text, partial=False)
        self.calls = final.calls
        return self._emit(final)

    def _emit(self, p: Parse) -> tuple[str, list[dict]]:
        content = ""
        if p.content.startswith(self.sent_content):
            content = p.content[len(self.sent_content) :]
            self.sent_content = p.content
        deltas: list[dict] = []
        # A call goes out whole, once it is complete and well formed: a call the final answer
        # would drop (cut by max_tokens, malformed later on) is never streamed.
        for i, call in enumerate(c for c in p.calls if c.done):
            if i >= len(self.sent):
                cid = new_call_id()
                self.sent.append([cid, ""])
                deltas.append(
                    {"index": i, "id": cid, "type": "function", "function": {"name": call.name, "arguments": ""}}
                )
            sent = self.sent[i][1]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                frag = call.arguments[len(sent) :]
                self.sent[i][1] = call.arguments
                if deltas and deltas[-1]["index"] == i and not deltas[-1]["function"]["arguments"]:
                    deltas[-1]["function"]["arguments"] = frag
                else:
                    deltas.append({"index": i, "function": {"arguments": frag}})
        return content, deltas


def openai_tool_calls(calls: list[Call]) -> list[dict]:
    return [
        {"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
    ]
