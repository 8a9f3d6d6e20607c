"""DeepSeek-V3.2's own chat encoding (its release ships the encoder as Python; written anew here
from the format it produces). It differs from V4's DSML encoding (render.render_dsml):

- tools: V3.2's tools prompt, the schemas (the `function` objects) inside `<functions>`;
- every user turn opens the assistant turn at once: `<｜User｜>…<｜Assistant｜>` then `<think>`
  for the last user message in thinking mode, `</think>` otherwise;
- tool results are not a user turn: right after the calls, `\\n\\n<function_results>`, one
  `\\n<result>…</result>` per result in the order sent, `\\n</function_results>`, then `\\n\\n`
  and `<think>` (thinking) or `</think>`;
- calls: a `<｜DSML｜function_calls>` block; reasoning is kept only for the assistant messages
  after the last user message (`reasoning</think>` before the content);
- a developer message is a user turn: tools prompt, then `# The user's message is: …`.
"""

from __future__ import annotations

from typing import Sequence

from dsv4_serve.chat.pieces import (
    ChatOptions,
    Rendered,
    RenderError,
    _calls,
    _function,
    _json,
    _Out,
    dsml_call_block,
)
from dsv4_wire import chat_tokens as T

_D = T.DSML
_TOOLS_PROMPT_HEAD = (
    "## Tools\n"
    "You have access to a set of tools you can use to answer the user's question.\n"
    f'You can invoke functions by writing a "<{_D}function_calls>" block like the following as part of your '
    "reply to the user:\n"
    f"<{_D}function_calls>\n"
    f'<{_D}invoke name="$FUNCTION_NAME">\n'
    f'<{_D}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{_D}parameter>\n'
    "...\n"
    f"</{_D}invoke>\n"
    f'<{_D}invoke name="$FUNCTION_NAME2">\n'
    "...\n"
    f"</{_D}invoke>\n"
    f"</{_D}function_calls>\n"
    "String and scalar parameters should be specified as is without any escaping or quotes, while lists and "
    'objects should use JSON format. The "string" attribute should be set to "true" for string type parameters '
    'and "false" for other types (numbers, booleans, arrays, objects).\n'
    "If the thinking_mode is enabled, then after function results you should strongly consider outputting a "
    "thinking block. Here is an example:\n"
    f"<{_D}function_calls>\n...\n</{_D}function_calls>\n"
    "<function_results>\n...\n</function_results>\n"
    f"{T.THINK_START}...thinking about results{T.THINK_END}\n"
    "Here are the functions available in JSONSchema format:\n"
    "<functions>\n"
)
_TOOLS_PROMPT_TAIL = "\n</functions>\n"


def _tools(out: _Out, tools: list) -> None:
    out.add(_TOOLS_PROMPT_HEAD)
    for j, tool in enumerate(tools):
        if j:
            out.add("\n")
        out.user(_json(_function(tool)))
    out.add(_TOOLS_PROMPT_TAIL)


def render_v32(messages: Sequence[dict], opts: ChatOptions) -> Rendered:
    msgs = [dict(m) for m in messages]
    for m in msgs:
        if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise RenderError(f"unsupported chat role: {m['role']}")
    if opts.tools:
        if not msgs or msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": ""})
        msgs[0]["tools"] = opts.tools
    thinking = opts.thinking
    last_user = max((i for i, m in enumerate(msgs) if m["role"] in ("user", "developer")), default=-1)
    out = _Out()
    out.add(T.BOS)
    for i, m in enumerate(msgs):
        role = m["role"]
        if role == "system":
            out.user(m.get("content"))
            if m.get("tools"):
                out.add("\n\n")
                _tools(out, m["tools"])
        elif role in ("user", "developer"):
            out.add(T.USER)
            if role == "developer":
                if m.get("tools"):
                    out.add("\n\n")
                    _tools(out, m["tools"])
                out.add("\n\n# The user's message is: ")
            out.user(m.get("content"))
            out.add(T.ASSISTANT + (T.THINK_START if thinking and i == last_user else T.THINK_END))
        elif role == "tool":
            if i == 0 or msgs[i - 1]["role"] != "tool":
                out.add("\n\n<function_results>")
            out.add("\n<result>")
            out.user(m.get("content"))
            out.add("</result>")
            if i + 1 == len(msgs) or msgs[i + 1]["role"] != "tool":
                out.add("\n</function_results>\n\n" + (T.THINK_START if thinking and i >= last_user else T.THINK_END))
        else:  # assistant
            calls = _calls(m)
            if thinking and i > last_user:
                out.user(m.get("reasoning_content") or "")
                out.add(T.THINK_END)
            out.user(m.get("content") or "")
            if calls:
                dsml_call_block(out, calls, "function_calls")
            if calls or opts.add_generation_prompt or i + 1 < len(msgs):
                out.add(T.EOS)  # else: a last answer to continue (add_generation_prompt false)
    return Rendered(out.pieces, _ends_thinking(out))


def _ends_thinking(out: _Out) -> bool:
    for text, trusted in reversed(out.pieces):
        if text:
            return trusted and text.endswith(T.THINK_START)
    return False
