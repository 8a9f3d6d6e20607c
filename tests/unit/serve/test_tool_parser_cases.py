"""Tool-call and reasoning parsing as data: a model's text and what must come out, for every
DeepSeek format, non-streamed and streamed at every fixed chunk size from 1 to 20 characters, in
whole tokens (markers never split) and at random splits; then a fuzz test over generated outputs
(well formed, cut short, corrupted inside the block, markers inside argument strings).

The cases follow DeepSeek's formats as their encoders write them (V3, V3.1, V3.2, V4) and the
situations the peers' parser tests and bug reports cover. Where a peer extends the format, the
choice made is said next to the case."""

from __future__ import annotations

import json
import random
import re

import pytest

from dsv4_serve.chat.output import ChatOutput
from dsv4_serve.chat.registry import tool_parser
from dsv4_wire import chat_tokens as T

D = T.DSML
MARKERS = tuple(sorted({m for m in T.CHAT_ADDED_TOKENS if m not in (T.THINK_START, T.THINK_END)} | {D}, key=len))


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
        params = "".join(
            f'<{D}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</{D}parameter>\n"
            for k, v in args.items()
        )
        invokes.append(f'<{D}invoke name="{name}">\n{params}</{D}invoke>')
    return f"{before}\n\n<{D}{block}>\n" + "\n".join(invokes) + f"\n</{D}{block}>"


def v4(*calls, before=""):
    return dsml("tool_calls", *calls, before=before)


# (parser, starts in reasoning (None: no reasoning parser), model text, reasoning, content, calls)
CASES = [
    # -- V3.1
    ("deepseek_v31", None, v31(("f", '{"a": 1}')), None, None, [("f", {"a": 1})]),
    (
        "deepseek_v31",
        None,
        v31(("f", "{}"), ("g", '{"x": [1, {"y": null}]}'), before="Two. "),
        None,
        "Two. ",
        [("f", {}), ("g", {"x": [1, {"y": None}]})],
    ),
    ("deepseek_v31", None, v31(("f", '{"s": "a } ] \\" b"}')), None, None, [("f", {"s": 'a } ] " b'})]),
    ("deepseek_v31", None, v31(("f", '{"a": 1}'), after=" done"), None, " done", [("f", {"a": 1})]),
    ("deepseek_v31", None, v31(("f", '{"a":1}')), None, None, [("f", {"a": 1})]),  # compact JSON kept as written
    ("deepseek_v31", None, "no call here", None, "no call here", []),
    ("deepseek_v31", True, "think</think>" + v31(("f", "{}")), "think", None, [("f", {})]),
    ("deepseek_v31", True, "think</think>answer", "think", "answer", []),
    # arguments that are not an object: no call, no markup (vLLM keeps the text; we never leak markers)
    ("deepseek_v31", None, v31(("f", "[1]"), before="x"), None, "x", []),
    ("deepseek_v31", None, v31(("f", "{bad"), before="x"), None, "x", []),
    # cut by max_tokens in the second call: the first is returned
    ("deepseek_v31", None, v31(("f", "{}"), ("g", '{"a": 1}'))[:-20], None, None, [("f", {})]),
    # the model ended after its last call without closing the block
    ("deepseek_v31", None, v31(("f", "{}"))[: -len(T.TOOL_CALLS_END)], None, None, [("f", {})]),
    # -- V3
    ("deepseek_v3", None, v3(("f", '{"a": "b"}'), before="ok"), None, "ok", [("f", {"a": "b"})]),
    ("deepseek_v3", None, v3(("f", "{}"), ("g", '{"n": 2}')), None, None, [("f", {}), ("g", {"n": 2})]),
    # -- V4 (DSML)
    ("deepseek_v4", None, v4(("f", {"a": "x", "n": 2}), before="Sure."), None, "Sure.", [("f", {"a": "x", "n": 2})]),
    (
        "deepseek_v4",
        None,
        v4(("f", {}), ("g", {"l": [1, 2], "o": {"k": True}})),
        None,
        None,
        [("f", {}), ("g", {"l": [1, 2], "o": {"k": True}})],
    ),
    ("deepseek_v4", None, v4(("f", {"s": "multi\nline <b> text"})), None, None, [("f", {"s": "multi\nline <b> text"})]),
    # string="false" with a value that is not JSON: kept as a string (as vLLM and SGLang do)
    (
        "deepseek_v4",
        None,
        v4(("f", {"a": 1})).replace('string="false">1', 'string="false">not json'),
        None,
        None,
        [("f", {"a": "not json"})],
    ),
    # thinking on, reasoning closed, then a call
    (
        "deepseek_v4",
        True,
        "plan</think>" + v4(("f", {"a": 1}), before="Calling."),
        "plan",
        "Calling.",
        [("f", {"a": 1})],
    ),
    # thinking on and never closed: the DSML start marker ends the reasoning (the call is not lost)
    ("deepseek_v4", True, "plan" + v4(("f", {"a": 1})), "plan\n\n", None, [("f", {"a": 1})]),
    # a newline before <think>, and <think> in the output although the prompt opened it
    ("deepseek_v4", False, "\n<think>hm</think>ok", "hm", "ok", []),
    ("deepseek_v4", True, "\n<think>hm</think>ok", "hm", "ok", []),
    ("deepseek_v4", True, "<think>hm</think>ok", "hm", "ok", []),
    # cut inside the second invoke: the first call stays, no markup in content
    ("deepseek_v4", None, v4(("f", {"a": 1}), ("g", {"b": 2}), before="x")[:-40], None, "x", [("f", {"a": 1})]),
    # cut inside the block's start marker: no markup in content
    ("deepseek_v4", None, "Let me look." + f"\n\n<{D}tool_ca", None, "Let me look.", []),
    # unknown attribute value: no call
    ("deepseek_v4", None, v4(("f", {"a": "x"})).replace('string="true"', 'string="maybe"'), None, None, []),
    ("deepseek_v4", None, "prose with < and </ and <b>", None, "prose with < and </ and <b>", []),
    # -- V3.2 (DSML, function_calls)
    ("deepseek_v32", None, dsml("function_calls", ("f", {"q": "x"})), None, None, [("f", {"q": "x"})]),
    ("deepseek_v32", True, "r</think>" + dsml("function_calls", ("f", {})), "r", None, [("f", {})]),
]


def ids(case):
    return f"{case[0]}-{CASES.index(case)}"


def whole(parser, start, text):
    msg = ChatOutput(tool_parser(parser), start).message(text)
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])]
    return msg.get("reasoning_content"), msg.get("content"), calls


def streamed(parser, start, pieces):
    out = ChatOutput(tool_parser(parser), start)
    reasoning, content, calls = "", "", {}
    for d in [out.feed(p) for p in pieces] + [out.finish()]:
        reasoning += d.get("reasoning_content", "")
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] not in calls, "id and name are sent once"
                calls[tc["index"]] = [tc["function"]["name"], ""]
            calls[tc["index"]][1] += tc["function"].get("arguments", "")
    return reasoning or None, content or None, [tuple(calls[i]) for i in sorted(calls)]


_TOKEN = re.compile("|".join(re.escape(m) for m in sorted(T.CHAT_ADDED_TOKENS, key=len, reverse=True)) + r"|\w+|\s+|.")


def chunkings(text: str, rng: random.Random):
    for size in range(1, 21):
        yield [text[i : i + size] for i in range(0, len(text), size)]
    yield _TOKEN.findall(text)  # whole tokens: markers arrive as one piece, as from the tokenizer
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_case(case):
    parser, start, text, reasoning, content, calls = case
    got_r, got_c, got_calls = whole(parser, start, text)
    assert (got_r, got_c or None) == (reasoning, content)
    assert [(n, json.loads(a)) for n, a in got_calls] == calls
    rng = random.Random(CASES.index(case))
    for pieces in chunkings(text, rng):
        assert streamed(parser, start, pieces) == (got_r, got_c or None, got_calls), pieces


# ---- fuzz -------------------------------------------------------------------------------------

_WORDS = ["a", "x y", "<b>", "</", "{", "}", '"', "\\", "\n", "é", "｜", "1", "null", "[]", " "]


def _value(rng: random.Random, depth=0):
    kind = rng.randrange(6 if depth < 2 else 4)
    if kind == 0:
        return "".join(rng.choice(_WORDS) for _ in range(rng.randint(0, 4)))
    if kind == 1:
        return rng.randint(-5, 500)
    if kind == 2:
        return rng.choice([True, False, None, 1.5])
    if kind == 3:
        return rng.choice(MARKERS) if rng.random() < 0.3 else "plain"  # a marker inside a string
    if kind == 4:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": _value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def _output(parser: str, rng: random.Random) -> tuple[str, bool]:
    """A generated model output in `parser`'s format and whether the output starts in reasoning."""
    calls = [
        (rng.choice(["f", "get_weather", "a_b"]), {f"p{i}": _value(rng) for i in range(rng.randint(0, 3))})
        for _ in range(rng.randint(0, 3))
    ]
    before = rng.choice(["", "Sure.", "text with < and </ in it", "line\n\n"])
    if parser == "deepseek_v31":
        text = v31(*[(n, json.dumps(a, ensure_ascii=False)) for n, a in calls], before=before) if calls else before
    elif parser == "deepseek_v3":
        text = v3(*[(n, json.dumps(a, ensure_ascii=False)) for n, a in calls], before=before) if calls else before
    else:
        text = (
            dsml("tool_calls" if parser == "deepseek_v4" else "function_calls", *calls, before=before)
            if calls
            else before
        )
    start = tool_parser(parser).start
    b = text.find(start)
    fate = rng.random()
    if b >= 0 and fate < 0.3:  # cut short (max_tokens)
        text = text[: rng.randint(0, len(text))]
    elif b >= 0 and fate < 0.5:  # corrupted inside the block
        at = rng.randint(b + len(start), len(text) - 1)
        text = text[:at] + rng.choice(["", "}", '"', "<", "\n", "x"]) + text[at + rng.randint(0, 3) :]
    thinking = rng.random() < 0.3
    if thinking:
        text = rng.choice(["I think.</think>", "plan\n", ""]) + text
    return text, thinking


def _fuzz(n: int, seed: int):
    rng = random.Random(seed)
    for k in range(n):
        parser = ("deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4")[k % 4]
        text, thinking = _output(parser, rng)
        reasoning, content, calls = whole(parser, True if thinking else None, text)
        if content:
            assert not any(m in content for m in MARKERS), (parser, text, content)
        for _, args in calls:
            assert isinstance(json.loads(args), dict), (parser, text)
        size = rng.randint(1, 20)
        for pieces in ([text[i : i + size] for i in range(0, len(text), size)], _TOKEN.findall(text)):
            assert streamed(parser, True if thinking else None, pieces) == (reasoning, content or None, calls), (
                parser,
                text,
                pieces,
            )


def test_fuzz_generated_outputs():
    _fuzz(1500, seed=42)


@pytest.mark.slow
def test_fuzz_generated_outputs_10k():
    _fuzz(10_000, seed=7)
