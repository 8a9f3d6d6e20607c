"""Rendering what agents send back, as DeepSeek's encoders do: parallel tool results in call order
(V4 pairs results with calls by position), two user messages in a row as one turn (V4), past calls
the server cut short or that carry `arguments: ""` rendered rather than refused, and `|tojson`
templates given past arguments as objects."""

from __future__ import annotations

import json

import pytest

from dsv4_serve.chat import ChatOptions
from dsv4_serve.chat.pieces import call_arguments
from dsv4_serve.chat.render import render, render_dsml
from dsv4_wire import chat_tokens as T

D = T.DSML


def _call(cid, name, args):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def test_v4_parallel_results_in_call_order():
    calls = [_call("c_a", "a", "{}"), _call("c_b", "b", "{}"), _call("c_c", "c", "{}")]
    head = [{"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": calls}]
    in_order = head + [{"role": "tool", "tool_call_id": f"c_{n}", "content": f"result {n}"} for n in "abc"]
    finished_order = head + [{"role": "tool", "tool_call_id": f"c_{n}", "content": f"result {n}"} for n in "cab"]
    want = render_dsml(in_order, ChatOptions()).text()
    assert render_dsml(finished_order, ChatOptions()).text() == want
    assert want.index("result a") < want.index("result b") < want.index("result c")


def test_v4_two_user_messages_in_a_row_are_one_turn():
    text = render_dsml([{"role": "user", "content": "one"}, {"role": "user", "content": "two"}], ChatOptions()).text()
    assert text.count(T.USER) == 1 and text.count(T.ASSISTANT) == 1
    assert "one\n\ntwo" in text


@pytest.mark.parametrize("renderer", ["deepseek_v4", "deepseek_v32", "deepseek_v31"])
@pytest.mark.parametrize("args", ["", '{"city": "Par', '{"city": "Paris", "days"'])
def test_past_call_cut_short_or_without_arguments_is_rendered(renderer, args):
    msgs = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [_call("c1", "get_weather", args)]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = render(renderer, None, msgs, ChatOptions()).text()
    assert "sunny" in text and "get_weather" in text
    if renderer != "deepseek_v31" and args:
        assert f'<{D}parameter name="city" string="true">Par' in text


def test_call_arguments_closes_what_was_cut():
    assert call_arguments("") == {}
    assert call_arguments('{"a": [1, {"b": "x') == {"a": [1, {"b": "x"}]}
    assert call_arguments('{"a": 1, "b"') == {"a": 1}
    assert call_arguments("[1, 2]") is None


TOJSON_TEMPLATE = (
    "{% for m in messages %}{% if m.tool_calls %}{% for t in m.tool_calls %}"
    "CALL {{ t.function.name }} {{ t.function.arguments | tojson }}\n{% endfor %}"
    "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
)


def test_tojson_template_gets_arguments_as_an_object():
    msgs = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [_call("c1", "f", '{"q": "a \\"quoted\\" <b>"}')]},
    ]
    r = render("jinja", TOJSON_TEMPLATE, msgs, ChatOptions(), reserved=(T.USER,))
    line = [ln for ln in r.text().splitlines() if ln.startswith("CALL")][0]
    assert json.loads(line.split(" ", 2)[2]) == {"q": 'a "quoted" <b>'}  # an object, not a quoted string
    # the argument text stays client text (untrusted), not template text
    assert any(not trusted and "quoted" in t for t, trusted in r.pieces)


def test_v32_renders_its_own_encoding():
    """V3.2's encoder, not V4's: its tools prompt (`<functions>`), results in `<function_results>`
    right after the calls (not a user turn), reasoning kept after the last user message."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    calls = [_call("c1", "f", '{"q": "x", "n": 2}'), _call("c2", "f", "")]
    msgs = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "reasoning_content": "plan", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]
    r = render("deepseek_v32", None, msgs, ChatOptions(tools=tools, thinking=True))
    text = r.text()
    assert "<functions>\n" + json.dumps(tools[0]["function"]) + "\n</functions>" in text
    assert f"{T.USER}go{T.ASSISTANT}{T.THINK_START}plan{T.THINK_END}\n\n<{D}function_calls>\n" in text
    assert f'<{D}parameter name="q" string="true">x</{D}parameter>\n<{D}parameter name="n" string="false">2' in text
    assert text.endswith(
        f"</{D}function_calls>{T.EOS}\n\n<function_results>\n<result>one</result>\n<result>two</result>"
        f"\n</function_results>\n\n{T.THINK_START}"
    )
    assert r.thinking and "<tool_result>" not in text and T.USER + "<" not in text
    off = render("deepseek_v32", None, msgs[:1], ChatOptions(tools=tools)).text()
    assert off.endswith(f"{T.USER}go{T.ASSISTANT}{T.THINK_END}")
