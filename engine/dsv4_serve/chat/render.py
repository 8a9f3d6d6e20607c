"""Chat messages -> prompt pieces, per DeepSeek model family (pure functions, no tokenizer).

A prompt is a list of pieces `(text, trusted)`. Trusted text is the renderer's own: it may spell
the family's special tokens, which the encoder turns into their ids. Untrusted text is what the
client sent (message content, tool schemas, tool-call names and arguments, tool results): it is
encoded as plain text, so a user cannot forge a turn boundary by typing `<｜Assistant｜>`.

Families (learned from DeepSeek's public templates and reference encoders, written anew here):
- `deepseek_v31`: DeepSeek-V3.1's template — system text, a `## Tools` section, `<｜User｜>` /
  `<｜Assistant｜>` turns opened by `</think>` (thinking off) or `<think>` (on), tool calls as
  `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>JSON<｜tool▁call▁end｜>...`, tool results as
  `<｜tool▁output▁begin｜>...<｜tool▁output▁end｜>` right after the call.
- `deepseek_v4`: the DSML encoding (V4 ships it as Python, not Jinja): tool schemas in the
  system prompt, calls as a `<｜DSML｜tool_calls>` block of `invoke`/`parameter` elements, tool results as `<tool_result>` blocks inside the next user
  turn, `reasoning_effort` as a prefix of the first message (the checkpoint's tiers: effort.py), and earlier turns' reasoning dropped
  unless tools are present.
- `deepseek_v32`: V3.2's own encoding (render_v32): DSML `function_calls` blocks, tool results in
  `<function_results>` right after the calls.
- `jinja`: any Jinja template (the checkpoint's, or `--chat-template FILE`), rendered as
  transformers does, client strings swapped for markers so they stay untrusted.

Rendering is deterministic: the same messages always give the same pieces, and an agent's round
N+1 (round N's messages + the assistant's reply + tool results) starts with round N's prompt.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional, Sequence

from dsv4_wire import chat_tokens as T

from dsv4_serve.chat.pieces import (
    ChatOptions,
    Piece,
    Rendered,
    RenderError,
    _calls,
    _function,
    _json,
    _Out,
    call_arguments,
    dsml_call_block,
)
from dsv4_serve.chat.effort import effort_prompt
from dsv4_serve.chat.render_v32 import render_v32


# ---- DeepSeek-V3.1 ---------------------------------------------------------------------------

_V31_FORMAT = (
    "\n\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
    f"{T.TOOL_CALLS_BEGIN}{T.TOOL_CALL_BEGIN}tool_call_name{T.TOOL_SEP}tool_call_arguments{T.TOOL_CALL_END}"
    "{additional_tool_calls}"
    f"{T.TOOL_CALLS_END}\n\n"
    "Where:\n"
    "- `tool_call_name` must be an exact match to one of the available tools\n"
    "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
    "- For multiple tool calls, chain them directly without separators or spaces"
)


def render_v31(messages: Sequence[dict], opts: ChatOptions) -> Rendered:
    out = _Out()
    out.add(T.BOS)
    systems = [m.get("content") or "" for m in messages if m["role"] in ("system", "developer")]
    for i, s in enumerate(systems):
        if i:
            out.add("\n\n")
        out.user(s)
    if opts.tools:
        out.add("\n\n## Tools\nYou have access to the following tools:\n")
        for tool in opts.tools:
            fn = _function(tool)
            out.add("\n### ")
            out.user(str(fn.get("name", "")))
            out.add("\nDescription: ")
            out.user(str(fn.get("description") or ""))
            out.add("\n\nParameters: ")
            out.user(_json(fn.get("parameters") or {}))
            out.add("\n")
        out.add(_V31_FORMAT.removeprefix("\n"))
    after_user = after_tool = False
    for m in messages:
        role = m["role"]
        if role == "user":
            out.add(T.USER)
            out.user(m.get("content"))
            after_user, after_tool = True, False
        elif role == "assistant":
            calls = _calls(m)
            if after_user:
                out.add(T.ASSISTANT + T.THINK_END)
            content = m.get("content") or ""
            if not calls and not after_tool and T.THINK_END in content:
                content = content.split(T.THINK_END, 1)[1]  # earlier reasoning is never re-sent
            out.user(content)
            if calls:
                out.add(T.TOOL_CALLS_BEGIN)
                for fn in calls:
                    out.add(T.TOOL_CALL_BEGIN)
                    out.user(str(fn.get("name", "")))
                    out.add(T.TOOL_SEP)
                    out.user(str(fn.get("arguments") or "{}"))  # clients send "" for a call without arguments
                    out.add(T.TOOL_CALL_END)
                out.add(T.TOOL_CALLS_END)
            out.add(T.EOS)
            after_user = after_tool = False
        elif role == "tool":
            out.add(T.TOOL_OUTPUT_BEGIN)
            out.user(m.get("content"))
            out.add(T.TOOL_OUTPUT_END)
            after_user, after_tool = False, True
        elif role not in ("system", "developer"):
            raise RenderError(f"unsupported chat role: {role}")
    thinking = False
    if opts.add_generation_prompt and after_user:
        thinking = opts.thinking
        out.add(T.ASSISTANT + (T.THINK_START if thinking else T.THINK_END))
    return Rendered(out.pieces, thinking)


# ---- DeepSeek-V3.2 / V4 (DSML) ------------------------------------------------------------------


def _dsml_tools_prompt(block: str) -> str:
    d = T.DSML
    return (
        "## Tools\n\n"
        f"You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
        f'"<{d}{block}>" block like the following:\n\n'
        f'<{d}{block}>\n<{d}invoke name="$TOOL_NAME">\n'
        f'<{d}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}parameter>\n...\n'
        f'</{d}invoke>\n<{d}invoke name="$TOOL_NAME2">\n...\n</{d}invoke>\n</{d}{block}>\n\n'
        'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
        'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
        f"If thinking_mode is enabled (triggered by {T.THINK_START}), you MUST output your complete reasoning inside "
        f"{T.THINK_START}...{T.THINK_END} BEFORE any tool calls or final response.\n\n"
        f"Otherwise, output directly after {T.THINK_END} with tool calls or final response.\n\n"
        "### Available Tool Schemas\n\n"
    )


_DSML_TOOLS_TAIL = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)


def _merge_tool_results(messages: Sequence[dict]) -> list[dict]:
    """Tool results and user messages in a row become one user turn of blocks (DeepSeek's V4
    encoder merges them: two user messages in a row are one turn, not two)."""
    merged: list[dict] = []
    for m in messages:
        role = m["role"]
        if role in ("tool", "user"):
            block = ("tool" if role == "tool" else "text", m.get("content") or "")
            if merged and merged[-1]["role"] == "user":
                merged[-1]["blocks"].append(block)
            else:
                merged.append({"role": "user", "blocks": [block]})
        else:
            merged.append(dict(m))
    return merged


def results_in_call_order(messages: Sequence[dict]) -> list[dict]:
    """Each run of tool results put in the order of the calls they answer (by `tool_call_id`),
    as DeepSeek's V4 encoder does: the prompt carries no ids, so the model pairs results with
    calls by position. Results whose id names no call rank as the first call (as the encoder
    ranks them; the sort is stable)."""
    out = list(messages)
    i = 0
    while i < len(out):
        j = i
        while j < len(out) and out[j]["role"] == "tool":
            j += 1
        if j > i and i > 0 and out[i - 1]["role"] == "assistant":
            ids = [c.get("id") for c in out[i - 1].get("tool_calls") or []]
            rank = {cid: k for k, cid in enumerate(ids) if cid}
            out[i:j] = sorted(out[i:j], key=lambda m: rank.get(m.get("tool_call_id"), 0))
        i = j + 1
    return out


def _last_user(messages: Sequence[dict]) -> int:
    return max((i for i, m in enumerate(messages) if m["role"] in ("user", "developer")), default=-1)


def render_dsml(messages: Sequence[dict], opts: ChatOptions, block: str = "tool_calls") -> Rendered:
    msgs = [dict(m) for m in messages]
    for m in msgs:
        if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise RenderError(f"unsupported chat role: {m['role']}")
    if opts.tools:
        if not msgs or msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": ""})
        msgs[0]["tools"] = opts.tools
    msgs = _merge_tool_results(results_in_call_order(msgs) if block == "tool_calls" else msgs)
    thinking = opts.thinking
    drop = not opts.tools  # earlier reasoning is dropped unless tools are present
    last_user = _last_user(msgs)
    out = _Out()
    out.add(T.BOS)
    opens_thinking = False
    for i, m in enumerate(msgs):
        role = m["role"]
        if i == 0 and thinking:
            out.add(effort_prompt(opts.effort_profile, opts.reasoning_effort))
        if role in ("system", "developer"):
            if role == "developer":
                out.add(T.USER)
            out.user(m.get("content"))
            if m.get("tools"):
                out.add("\n\n" + _dsml_tools_prompt(block))
                for j, tool in enumerate(m["tools"]):
                    if j:
                        out.add("\n")
                    out.user(_json(_function(tool)))
                out.add(_DSML_TOOLS_TAIL)
        elif role == "user":
            out.add(T.USER)
            for j, (kind, text) in enumerate(m["blocks"]):
                if j:
                    out.add("\n\n")
                if kind == "tool":
                    out.add(T.TOOL_RESULT_OPEN)
                    out.user(text)
                    out.add(T.TOOL_RESULT_CLOSE)
                else:
                    out.user(text)
        elif role == "assistant":
            if thinking and (not drop or i > last_user):
                out.user(m.get("reasoning_content") or "")
                out.add(T.THINK_END)
            out.user(m.get("content") or "")
            calls = _calls(m)
            if calls:
                dsml_call_block(out, calls, block)
            out.add(T.EOS)
        if i + 1 < len(msgs) and msgs[i + 1]["role"] != "assistant":
            continue
        if role in ("user", "developer") and (opts.add_generation_prompt or i + 1 < len(msgs)):
            opens = thinking and (not drop or i >= last_user)
            out.add(T.ASSISTANT + (T.THINK_START if opens else T.THINK_END))
            opens_thinking = opens and i + 1 == len(msgs)
    return Rendered(out.pieces, opens_thinking)


# ---- any Jinja template ----------------------------------------------------------------------------

_MARK = "\ue000{}\ue001"
_MARKER = re.compile("\ue000([0-9]+)\ue001")
# Fields whose values templates compare (`message.role == 'user'`, `tool.type == 'function'`):
# validated enumerations, left as they are unless they spell a special token.
_COMPARED_FIELDS = frozenset({"role", "type"})
_TOJSON_ARGUMENTS = re.compile(r"arguments['\"]?\]?\s*\|\s*tojson")


def _arguments_as_objects(m: dict) -> dict:
    """A message whose tool calls carry their arguments as objects (an unreadable one as {})."""
    if not m.get("tool_calls"):
        return m
    calls = []
    for c in m["tool_calls"]:
        fn = c.get("function") or {}
        calls.append({**c, "function": {**fn, "arguments": call_arguments(fn.get("arguments")) or {}}})
    return {**m, "tool_calls": calls}


def render_jinja(
    template: str, messages: Sequence[dict], opts: ChatOptions, bos: str, eos: str, reserved: Sequence[str]
) -> Rendered:
    """Render with a Jinja template. Every client string (issue 39: tool descriptions, reasoning,
    tool-call ids and chat_template_kwargs values too) is swapped for a private-use marker first,
    so that the output can be cut back into trusted template text and untrusted client text.
    Strings a template compares (roles, `type`s, dict keys, chat_template_kwargs values) stay as
    they are unless they spell a special token, so a template's own variables keep working. A
    template that transforms a string (so its marker does not survive) falls back to the plain
    render, which is refused if a client string spells one of the `reserved` (special) tokens."""
    from dsv4_engine.tokenizer import render_jinja_text

    originals: list[str] = []

    def spelled(s: str) -> bool:
        return any(tok and tok in s for tok in reserved) or "\ue000" in s or "\ue001" in s

    def mark(x: Any, compared: bool = False) -> Any:
        if isinstance(x, str):
            if not x or (compared and not spelled(x)):
                return x
            originals.append(x)
            return _MARK.format(len(originals) - 1)
        if isinstance(x, dict):
            return {mark(k, True): mark(v, compared or k in _COMPARED_FIELDS) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [mark(v, compared) for v in x]
        return x

    def tojson_hook(text: str) -> str:
        # a marked string inside JSON: its text must be the JSON-escaped original
        def escaped(m: "re.Match[str]") -> str:
            originals.append(json.dumps(originals[int(m.group(1))], ensure_ascii=False)[1:-1])
            return _MARK.format(len(originals) - 1)

        return _MARKER.sub(escaped, text)

    # vLLM gives templates that write `arguments|tojson` (its V3/R1 tool templates) the arguments
    # as an object: with the JSON text, tojson would write a quoted string, markers inside.
    if _TOJSON_ARGUMENTS.search(template) is not None:
        messages = [_arguments_as_objects(m) for m in messages]
    marked = [mark(dict(m)) for m in messages]
    variables = {k: mark(v, True) for k, v in opts.template_kwargs.items()}
    variables.setdefault("thinking", opts.thinking)
    variables.setdefault("enable_thinking", opts.thinking)
    if opts.reasoning_effort is not None:
        variables.setdefault("reasoning_effort", mark(opts.reasoning_effort, True))
    if opts.tools:
        variables["tools"] = mark(list(opts.tools))
    sent = len(originals)
    text = render_jinja_text(template, marked, opts.add_generation_prompt, bos, eos, variables, tojson_hook)
    pieces: list[Piece] = []
    pos = 0
    for m in _MARKER.finditer(text):
        pieces.append((text[pos : m.start()], True))
        pieces.append((originals[int(m.group(1))], False))  # < len(originals): only ours are in `text`
        pos = m.end()
    pieces.append((text[pos:], True))
    # A marker the template cut or reversed leaves a stray delimiter; one it dropped leaves nothing
    # (a template need not render ids or descriptions), and one it kept whole is client text.
    mangled = any("\ue000" in t or "\ue001" in t for t, trusted in pieces if trusted)
    if not mangled:
        return Rendered([p for p in pieces if p[0]], text.rstrip().endswith(T.THINK_START))
    # The template changed some string: render the real strings and check them instead.
    for s in originals[:sent]:
        for tok in reserved:
            if tok and tok in s:
                raise RenderError(
                    f"message text contains the special token {tok!r}, which this chat template "
                    "cannot keep as plain text"
                )
    variables = dict(opts.template_kwargs)
    variables.setdefault("thinking", opts.thinking)
    variables.setdefault("enable_thinking", opts.thinking)
    if opts.reasoning_effort is not None:
        variables.setdefault("reasoning_effort", opts.reasoning_effort)
    if opts.tools:
        variables["tools"] = opts.tools
    text = render_jinja_text(template, list(messages), opts.add_generation_prompt, bos, eos, variables)
    return Rendered([(text, True)], text.rstrip().endswith(T.THINK_START))


def render(
    setup_renderer: str,
    template: Optional[str],
    messages: Sequence[dict],
    opts: ChatOptions,
    bos: str = T.BOS,
    eos: str = T.EOS,
    reserved: Sequence[str] = (),
) -> Rendered:
    """Dispatch on the renderer name (see registry.RENDERERS)."""
    if setup_renderer == "deepseek_v31":
        return render_v31(messages, opts)
    if setup_renderer == "deepseek_v4":
        return render_dsml(messages, opts, "tool_calls")
    if setup_renderer == "deepseek_v32":
        return render_v32(messages, opts)
    if template is None:
        raise RenderError("this model has no chat template (give one with --chat-template FILE)")
    return render_jinja(template, messages, opts, bos, eos, reserved)
