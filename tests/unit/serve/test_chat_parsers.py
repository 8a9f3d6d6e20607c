"""Tool-call and reasoning parsers: each format non-streamed, streamed at every split point of
the text (the deltas assemble to the same calls and content), parallel calls, malformed output."""

from __future__ import annotations

import json

import pytest

from dsv4_serve.chat.output import ChatOutput, reasoning_tokens
from dsv4_serve.chat.reasoning import split_reasoning
from dsv4_serve.chat.registry import tool_parser
from dsv4_wire import chat_tokens as T

D = T.DSML


def v31(*calls, before="", after=""):
    body = "".join(f"{T.TOOL_CALL_BEGIN}{n}{T.TOOL_SEP}{a}{T.TOOL_CALL_END}" for n, a in calls)
    return f"{before}{T.TOOL_CALLS_BEGIN}{body}{T.TOOL_CALLS_END}{after}"


def v3(*calls, before=""):
    body = "\n".join(
        f"{T.TOOL_CALL_BEGIN}function{T.TOOL_SEP}{n}\n```json\n{a}\n```{T.TOOL_CALL_END}" for n, a in calls
    )
    return f"{before}{T.TOOL_CALLS_BEGIN}{body}{T.TOOL_CALLS_END}"


def dsml(block, *calls, before=""):
    invokes = []
    for name, args in calls:
        params = "\n".join(
            f'<{D}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else json.dumps(v)}</{D}parameter>"
            for k, v in args.items()
        )
        invokes.append(f'<{D}invoke name="{name}">\n{params}\n</{D}invoke>')
    return f"{before}\n\n<{D}{block}>\n" + "\n".join(invokes) + f"\n</{D}{block}>"


ARGS = {"city": "Paris <b>", "days": 2, "opts": {"unit": "C", "list": [1, 2]}, "ok": True}
CASES = [
    (
        "deepseek_v31",
        v31(("get_weather", json.dumps(ARGS)), before="Let me check. "),
        "Let me check. ",
        [("get_weather", ARGS)],
    ),
    ("deepseek_v31", v31(("a", "{}"), ("b", '{"x": 1}')), "", [("a", {}), ("b", {"x": 1})]),
    (
        "deepseek_v3",
        v3(("get_weather", json.dumps(ARGS)), ("b", "{}"), before="ok"),
        "ok",
        [("get_weather", ARGS), ("b", {})],
    ),
    (
        "deepseek_v4",
        dsml("tool_calls", ("get_weather", ARGS), ("noop", {}), before="Sure."),
        "Sure.",
        [("get_weather", ARGS), ("noop", {})],
    ),
    ("deepseek_v32", dsml("function_calls", ("get_weather", ARGS)), "", [("get_weather", ARGS)]),
    ("deepseek_v4", "no calls here, just < and </ text", "no calls here, just < and </ text", []),
    ("deepseek_v31", "plain <｜tool", "plain ", []),  # a marker cut short is not content
]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_parse_whole_text(name, text, content, calls):
    msg = ChatOutput(tool_parser(name), None).message(text)
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])]
    assert got == calls
    assert (msg["content"] or "") == content
    for c in msg.get("tool_calls", []):
        assert c["type"] == "function" and c["id"].startswith("call_")


def assemble(out: ChatOutput, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]], list[str]]:
    """Feed pieces; return (reasoning, content, [(name, arguments)], ids) as a client assembles them."""
    reasoning, content, calls, ids = "", "", {}, {}
    deltas = [out.feed(p) for p in pieces] + [out.finish()]
    for d in deltas:
        reasoning += d.get("reasoning_content", "")
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            i = tc["index"]
            if "id" in tc:
                assert i not in ids, "id and name are sent once"
                ids[i] = tc["id"]
                calls[i] = [tc["function"]["name"], ""]
            calls[i][1] += tc["function"].get("arguments", "")
    return reasoning, content, [tuple(calls[i]) for i in sorted(calls)], list(ids.values())


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_streamed_at_every_split_point(name, text, content, calls):
    whole = ChatOutput(tool_parser(name), None).message(text)
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])]
    for cut in range(len(text) + 1):
        for cut2 in (cut, min(len(text), cut + 7)):
            pieces = [text[:cut], text[cut:cut2], text[cut2:]]
            _, got_content, got_calls, _ = assemble(ChatOutput(tool_parser(name), None), pieces)
            assert got_calls == want, (cut, cut2)
            assert got_content == content, (cut, cut2)
    # character by character: each call goes out once, whole, when it is complete
    out = ChatOutput(tool_parser(name), None)
    frags = [c for d in (out.feed(ch) for ch in text) for c in d.get("tool_calls", [])]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in frags] == want


MALFORMED = [
    ("deepseek_v31", v31(("f", "{not json"))),
    ("deepseek_v31", v31(("f", "[1, 2]"))),
    ("deepseek_v31", f'x{T.TOOL_CALLS_BEGIN}{T.TOOL_CALL_BEGIN}f{T.TOOL_SEP}{{"a": 1'),  # cut off by max_tokens
    ("deepseek_v3", v3(("f", "{oops"))),
    ("deepseek_v4", f'<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="a" string="maybe">1</{D}parameter>'),
]


@pytest.mark.parametrize(
    "name,text",
    [
        ("deepseek_v4", dsml("tool_calls", ("f", {"a": "x"}), ("g", {"b": [1, 2]}), before="On it.")),
        ("deepseek_v31", v31(("f", '{"a": "x"}'), ("g", '{"b": [1, 2]}'), before="On it.")),
    ],
)
def test_cut_mid_parallel_calls_keeps_the_complete_ones(name, text):
    """max_tokens ends the output inside the second of two calls: the first is returned, no
    markup is content, and the stream says the same at every split."""
    cut = text.find('"b"' if name == "deepseek_v31" else 'name="b"') + 2
    last_close = text.rfind(T.TOOL_CALL_END if name == "deepseek_v31" else f"</{D}invoke>")
    for end in range(cut, last_close + 1):
        partial_out = text[:end]
        msg = ChatOutput(tool_parser(name), None).message(partial_out)
        assert msg["content"] == "On it." and [c["function"]["name"] for c in msg["tool_calls"]] == ["f"], end
        for at in (1, 5, end // 2):
            _, content, calls, _ = assemble(ChatOutput(tool_parser(name), None), [partial_out[:at], partial_out[at:]])
            assert content == "On it." and [c[0] for c in calls] == ["f"]


@pytest.mark.parametrize("name,text", MALFORMED)
def test_malformed_blocks_give_no_call_and_no_markup(name, text):
    """A block with no well-formed call: no call, and its markup is not content (it used to be
    returned as content, markers and all)."""
    before = text[: text.find(tool_parser(name).start)]
    msg = ChatOutput(tool_parser(name), None).message(text)
    assert "tool_calls" not in msg and msg["content"] == before.rstrip("\n")
    for cut in range(0, len(text) + 1, 3):
        out = ChatOutput(tool_parser(name), None)
        _, content, calls, _ = assemble(out, [text[:cut], text[cut:]])
        assert content == before.rstrip("\n") and not calls and not out.has_calls


REASONING = [
    (True, "I should look.</think>The answer.", "I should look.", "The answer."),
    (False, "<think>hmm</think>ok", "hmm", "ok"),
    (False, "no thinking", "", "no thinking"),
    (True, "ran out while thinking <", "ran out while thinking <", ""),
    (True, f"plan</think>\n\n<{D}tool_calls>", "plan", f"\n\n<{D}tool_calls>"),
]


@pytest.mark.parametrize("start,text,reasoning,content", REASONING)
def test_reasoning_split_streamed_at_every_split_point(start, text, reasoning, content):
    assert split_reasoning(text, start)[:2] == (reasoning, content)
    for cut in range(len(text) + 1):
        got_r, got_c, _, _ = assemble(ChatOutput(None, start), [text[:cut], text[cut:]])
        assert (got_r, got_c) == (reasoning, content), cut


def test_reasoning_then_tool_calls_v4():
    text = "plan it</think>" + dsml("tool_calls", ("f", {"a": 1}), before="Calling.")
    msg = ChatOutput(tool_parser("deepseek_v4"), True).message(text)
    assert msg["reasoning_content"] == "plan it" and msg["content"] == "Calling."
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"a": 1}
    for cut in range(len(text) + 1):
        r, c, calls, _ = assemble(ChatOutput(tool_parser("deepseek_v4"), True), [text[:cut], text[cut:]])
        assert (r, c, calls) == ("plan it", "Calling.", [("f", '{"a": 1}')])


def test_reasoning_token_count():
    assert reasoning_tokens([5, 6, 7, 9, 8], 9, True) == 3
    assert reasoning_tokens([5, 6], 9, True) == 2
    assert reasoning_tokens([5, 6], 9, False) == 0


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = v31(("a", "{}"), ("b", '{"x": 1}'))
    msg = ChatOutput(tool_parser("deepseek_v31"), None, parallel=False).message(text)
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["a"]
    _, _, calls, _ = assemble(ChatOutput(tool_parser("deepseek_v31"), None, parallel=False), [text[:30], text[30:]])
    assert calls == [("a", "{}")]
