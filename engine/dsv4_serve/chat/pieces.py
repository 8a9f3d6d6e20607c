"""What every chat renderer is made of: prompt pieces (text, trusted), the options, the result,
and the helpers they share (pure functions)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from dsv4_wire import chat_tokens as T

Piece = tuple[str, bool]  # (text, trusted)


class RenderError(ValueError):
    """The messages cannot be rendered in this format (a 400 naming `messages`)."""


@dataclass
class ChatOptions:
    tools: Optional[list[dict]] = None  # OpenAI tool objects; None when tool_choice is "none"
    thinking: bool = False
    reasoning_effort: Optional[str] = None
    effort_profile: Optional[str] = "v4"  # the checkpoint's effort tiers (chat/effort.py)
    add_generation_prompt: bool = True
    template_kwargs: dict = field(default_factory=dict)  # chat_template_kwargs, for Jinja templates


@dataclass
class Rendered:
    pieces: list[Piece]
    thinking: bool  # the prompt leaves the model inside a <think> block

    def text(self) -> str:
        return "".join(t for t, _ in self.pieces)


class _Out:
    def __init__(self) -> None:
        self.pieces: list[Piece] = []

    def add(self, text: str) -> None:
        if text:
            self.pieces.append((text, True))

    def user(self, text: Optional[str]) -> None:
        if text:
            self.pieces.append((text, False))


def _json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


def _function(tool: dict) -> dict:
    if (
        not isinstance(tool, dict)
        or tool.get("type", "function") != "function"
        or not isinstance(tool.get("function"), dict)
    ):
        raise RenderError('each tool must be {"type": "function", "function": {...}}')
    return tool["function"]


def _calls(m: dict) -> list[dict]:
    return [c.get("function") or {} for c in (m.get("tool_calls") or [])]


def call_arguments(arguments: Any) -> Optional[dict]:
    """A past call's arguments as an object: "" (clients send it for a call without arguments)
    is {}, and a call cut short (JSON ended early, as a max_tokens cut leaves it) is closed as far
    as it got ({} when even that fails). None when it is JSON but not an object."""
    if isinstance(arguments, dict):
        return arguments
    text = (arguments or "").strip() or "{}"
    for candidate in (text, _closed(text)):
        try:
            value = json.loads(candidate)
        except (TypeError, ValueError):
            continue
        return value if isinstance(value, dict) else None
    return {}  # beyond repair: the call is still rendered (its name), not refused


def _closed(text: str) -> str:
    """JSON text cut short, completed: an open string closed, a dangling comma, colon or key
    dropped, open arrays and objects closed."""
    stack: list[str] = []
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            stack.append("]" if ch == "[" else "}")
        elif ch in "]}" and stack:
            stack.pop()
    if in_str:
        text = (text[:-1] if esc else text) + '"'
    text = text.rstrip().rstrip(",:").rstrip()
    if stack and stack[-1] == "}" and text.endswith('"'):
        # an object's last string may be a key without its value: drop it when it follows { or ,
        k = len(text) - 1
        while k > 0 and not (text[k - 1] == '"' and (k < 2 or text[k - 2] != "\\")):
            k -= 1
        head = text[: k - 1].rstrip()
        if head.endswith(("{", ",")):
            text = head.rstrip(",")
    return text + "".join(reversed(stack))


def _dsml_value(value: Any) -> tuple[str, str]:
    return (value, "true") if isinstance(value, str) else (_json(value), "false")


def dsml_call_block(out: _Out, calls: list[dict], block: str) -> None:
    """Past tool calls as a DSML `block` (V4's `tool_calls`, V3.2's `function_calls`) of
    `invoke`/`parameter` elements; names, keys and values are the client's text."""
    d = T.DSML
    out.add(f"\n\n<{d}{block}>\n")
    for k, fn in enumerate(calls):
        args = call_arguments(fn.get("arguments"))
        if args is None:
            raise RenderError(f"tool call arguments must be a JSON object (call {fn.get('name')!r})")
        if k:
            out.add("\n")
        out.add(f'<{d}invoke name="')
        out.user(str(fn.get("name", "")))
        out.add('">\n')
        for n, (key, value) in enumerate(args.items()):
            text, is_string = _dsml_value(value)
            if n:
                out.add("\n")
            out.add(f'<{d}parameter name="')
            out.user(str(key))
            out.add(f'" string="{is_string}">')
            out.user(text)
            out.add(f"</{d}parameter>")
        out.add(f"\n</{d}invoke>")
    out.add(f"\n</{d}{block}>")
