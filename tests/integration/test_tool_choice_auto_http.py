"""`tool_choice: "auto"` through `dsv4 serve` with the official `openai` client, on random weights:
the answer is free text until the format's tool-call marker, then a well-formed call. The marker
tokens get a logit bias so that a random model opens calls often; under the grammar every call it
opens is complete and valid (or the answer ran out of tokens and has no call), no markup leaks into
`content`, `finish_reason` is `tool_calls` whenever calls come back, and the streamed answer
assembles to the non-streamed one (seeded sampling). `--disable-auto-tool-grammar` gives the raw
model back (slow: a second server)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from bench.harness.commands import serving
from dsv4_wire import chat_tokens as T
from tests.integration.test_tool_choice_http import with_longer_context

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 8},
                    "days": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]
MSGS = [{"role": "user", "content": "Weather in Paris?"}]
MARKERS = {  # the format's own tool-call markup
    "v4-tiny": (T.DSML,),
    "tiny": (T.TOOL_CALLS_BEGIN, T.TOOL_CALL_BEGIN, T.TOOL_SEP, T.TOOL_CALL_END, T.TOOL_CALLS_END),
}


def _serve(make_model, tmp_path_factory, preset, extra=()):
    model = make_model(preset)
    if preset == "v4-tiny":
        model = with_longer_context(model, tmp_path_factory.mktemp("v4-long") / "model")
    args = ["--model", model, "--kv-memory-gb", 0.1, "--max-num-seqs", 8, "--served-model-name", "m", *extra]
    if preset == "v4-tiny":
        args += ["--page-size", 8]
    return model, serving(args, tmp_path_factory.mktemp("auto") / "engine.log")


def _bias(model) -> dict:
    """Logit bias toward the tokens that open a call (the first token of the block marker)."""
    tok = json.loads((model / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    # V3.1: the block's one-token marker; DSML: "<", then `｜DSML｜` (allowed only right after "<")
    bias = {added[m]: b for m, b in ((T.DSML, 30), (T.TOOL_CALLS_BEGIN, 5)) if m in added}
    bias[tok["model"]["vocab"]["<"]] = 4
    return {str(i): b for i, b in bias.items()}


@pytest.fixture(scope="module", params=["v4-tiny", pytest.param("tiny", marks=pytest.mark.slow)])
def server(request, make_model, tmp_path_factory):
    model, ctx = _serve(make_model, tmp_path_factory, request.param)
    with ctx as url:
        yield request.param, model, openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)


def check(preset, choice) -> list:
    """The promise of `auto` under the grammar, for one choice; returns its calls as data."""
    msg = choice.message
    assert not any(m in (msg.content or "") for m in MARKERS[preset]), msg.content
    if not msg.tool_calls:
        assert choice.finish_reason in ("stop", "length"), choice
        return []
    assert choice.finish_reason == "tool_calls", choice
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    out = []
    for c in msg.tool_calls:
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, schemas[c.function.name])
        out.append((c.function.name, args))
    return out


def streamed(client, **kw):
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, ["", ""])
                if d.function and d.function.name:
                    call[0] = d.function.name
                call[1] += (d.function and d.function.arguments) or ""
    return content, [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))], finish


def test_auto_calls_are_well_formed_and_streaming_agrees(server):
    preset, model, client = server
    kw = dict(
        model="m",
        messages=MSGS,
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=240 if preset == "v4-tiny" else 120,
        temperature=1.0,
        logit_bias=_bias(model),
    )
    r = client.chat.completions.create(**kw, n=4, seed=11)
    got = [check(preset, c) for c in r.choices]
    assert any(got), [(c.finish_reason, c.message.content) for c in r.choices]
    for seed in (3,):
        whole = client.chat.completions.create(**kw, seed=seed).choices[0]
        calls = check(preset, whole)
        content, s_calls, finish = streamed(client, **kw, seed=seed)
        assert (content or None, s_calls, finish) == (whole.message.content or None, calls, whole.finish_reason)


@pytest.mark.slow
def test_disable_flag_gives_the_raw_model(make_model, tmp_path_factory):
    model, ctx = _serve(make_model, tmp_path_factory, "v4-tiny", ["--disable-auto-tool-grammar"])
    with ctx as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)
        r = client.chat.completions.create(
            model="m", messages=MSGS, tools=TOOLS, max_tokens=120, temperature=1.0, n=6, seed=5, logit_bias=_bias(model)
        )
        # unconstrained, the biased random model writes markers that are no call (dropped from content)
        assert not any(c.message.tool_calls for c in r.choices)


NESTED = {  # as pydantic writes a model with a nested model and an enum (instructor's TOOLS mode)
    "$defs": {
        "Addr": {
            "properties": {
                "city": {"maxLength": 6, "title": "City", "type": "string"},
                "zip": {"anyOf": [{"pattern": "^[0-9]{3}$", "type": "string"}, {"type": "null"}], "default": None},
            },
            "required": ["city"],
            "title": "Addr",
            "type": "object",
        },
        "Kind": {"enum": ["home", "work"], "title": "Kind", "type": "string"},
    },
    "properties": {"kind": {"$ref": "#/$defs/Kind"}, "addr": {"$ref": "#/$defs/Addr"}},
    "required": ["kind", "addr"],
    "title": "User",
    "type": "object",
}


def test_nested_pydantic_tool_named_and_auto(server):
    """A tool whose parameters use `$defs`/`$ref` is served (it was a 400 on DSML checkpoints),
    named as instructor names it and under auto with another tool beside it."""
    preset, model, client = server
    tools = [{"type": "function", "function": {"name": "User", "parameters": NESTED}}, TOOLS[1]]
    named = client.chat.completions.create(
        model="m",
        messages=MSGS,
        tools=tools[:1],
        tool_choice={"type": "function", "function": {"name": "User"}},
        max_tokens=300,
        temperature=0,
    ).choices[0]
    assert named.finish_reason == "tool_calls", named
    jsonschema.validate(json.loads(named.message.tool_calls[0].function.arguments), NESTED)
    auto = client.chat.completions.create(
        model="m", messages=MSGS, tools=tools, max_tokens=120, temperature=1.0, seed=2, logit_bias=_bias(model)
    ).choices[0]
    assert not any(m in (auto.message.content or "") for m in MARKERS[preset])


def test_auto_with_thinking(server):
    """Thinking on: reasoning first (no call inside it), then free text or a call."""
    preset, model, client = server
    tok = json.loads((model / "tokenizer.json").read_text())
    think_end = next(t["id"] for t in tok["added_tokens"] if t["content"] == T.THINK_END)
    r = client.chat.completions.create(
        model="m",
        messages=MSGS,
        tools=TOOLS,
        max_tokens=200,
        temperature=1.0,
        n=2,
        seed=4,
        logit_bias={**_bias(model), str(think_end): 3},
        extra_body={"chat_template_kwargs": {"thinking": True}},
    )
    for c in r.choices:
        check(preset, c)
        reasoning = getattr(c.message, "reasoning_content", None) or ""
        assert not any(m in reasoning for m in MARKERS[preset])
