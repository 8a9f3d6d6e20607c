"""`tool_choice: "required"` and a named tool through `dsv4 serve` on random-weight V3 (`tiny`,
V3.1 format) and V4 (`v4-tiny`, DSML) checkpoints, with the official `openai` client: the answer
is constrained to the model's native tool-call text, so even random weights ALWAYS return
`message.tool_calls` whose arguments are valid under the tool's schema, with
`finish_reason: "tool_calls"` — a property test over generated schemas. Streamed deltas assemble
to the non-streamed call; a tool-result round trip and n=2 work; tool_choice required combined with
another output constraint is a 400 naming it."""

from __future__ import annotations

import json
import random

import jsonschema
import openai
import pytest

from bench.harness.commands import serving

MAX_TOKENS = 300  # every generated schema is bounded (strings, arrays, numbers) well below this


def gen_schema(rng: random.Random, depth: int = 0) -> dict:
    """A random JSON Schema of the kinds agents send, every value bounded in length so that a
    call always finishes: nested objects, arrays, enums, required, additionalProperties false,
    string patterns, number ranges."""
    kinds = ["string_pattern", "string_len", "enum", "integer", "number", "boolean"]
    if depth < 2:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "string_pattern":
        return {"type": "string", "pattern": rng.choice(["^[a-z]{1,6}$", "^[A-Z][a-z]{0,4}$", "^[0-9]{2,4}$"])}
    if kind == "string_len":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(["red", "green", "blue", "C", "F", "north", "south"], 3)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 500)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": rng.choice([1, 10, 100])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {
            "type": "array",
            "items": gen_schema(rng, depth + 1),
            "minItems": rng.randint(0, 1),
            "maxItems": rng.randint(1, 3),
        }
    return gen_object(rng, depth + 1)


def gen_object(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(["city", "days", "unit", "query", "limit", "tags", "opts", "point", "flag"], rng.randint(1, 3))
    props = {n: gen_schema(rng, depth) for n in names}
    return {
        "type": "object",
        "properties": props,
        "required": rng.sample(names, rng.randint(0, len(names))),
        "additionalProperties": False,
    }


def gen_tools(seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "type": "function",
            "function": {"name": f"tool_{seed}_{i}", "description": f"tool number {i}", "parameters": gen_object(rng)},
        }
        for i in range(rng.randint(1, 2))
    ]


SCHEMA_SEEDS = range(12)
MSGS = [{"role": "user", "content": "Use a tool."}]


def with_longer_context(model, out, positions: int = 2048):
    """A copy of the checkpoint with a longer context: v4-tiny's 1024 positions cannot hold the
    V4 encoding's tool preamble (~600 tokens with our tiny tokenizer) plus a call. Random weights
    do not care; the grammar is what is under test."""
    import shutil

    shutil.copytree(model, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["max_position_embeddings"] = positions
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module", params=["tiny", "v4-tiny"])
def server(request, make_model, tmp_path_factory):
    model = make_model(request.param)
    if request.param == "v4-tiny":
        model = with_longer_context(model, tmp_path_factory.mktemp("v4-long") / "model")
    args = ["--model", model, "--kv-memory-gb", 0.1, "--max-num-seqs", 8, "--served-model-name", "m"]
    if request.param == "v4-tiny":
        args += ["--page-size", 8]
    with serving(args, tmp_path_factory.mktemp("tool-choice") / "engine.log") as url:
        yield request.param, url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server[1]}/v1", api_key="none", timeout=120, max_retries=0)


def check_calls(choice, tools, only=None) -> list:
    """The choice is a tool call (or several) to allowed tools with schema-valid arguments."""
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls, choice
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for c in calls:
        assert c.type == "function" and c.id
        assert c.function.name in schemas and (only is None or c.function.name == only)
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
    return calls


def test_required_gives_a_valid_call(client):
    tools = gen_tools(2)  # the smallest of the generated sets: the fast check of the default run
    r = client.chat.completions.create(
        model="m",
        messages=MSGS,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert len(check_calls(r.choices[0], tools)) == 1


@pytest.mark.slow
def test_required_and_named_always_give_valid_calls(client):
    for seed in SCHEMA_SEEDS:
        tools = gen_tools(seed)
        r = client.chat.completions.create(
            model="m",
            messages=MSGS,
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        assert len(check_calls(r.choices[0], tools)) == 1
        name = tools[-1]["function"]["name"]
        r = client.chat.completions.create(
            model="m",
            messages=MSGS,
            tools=tools,
            max_tokens=MAX_TOKENS,
            tool_choice={"type": "function", "function": {"name": name}},
            temperature=1.0,
            seed=seed,
            parallel_tool_calls=False,
        )
        check_calls(r.choices[0], tools, only=name)


@pytest.mark.slow
def test_streamed_call_assembles_to_the_non_streamed_one(client):
    for seed in (3, 5):
        tools = gen_tools(seed)
        kw = dict(
            model="m",
            messages=MSGS,
            tools=tools,
            tool_choice="required",
            max_tokens=MAX_TOKENS,
            temperature=0,
            parallel_tool_calls=False,
        )
        whole = check_calls(client.chat.completions.create(**kw).choices[0], tools)
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(**kw, stream=True):
            for c in chunk.choices:
                finish = c.finish_reason or finish
                for d in c.delta.tool_calls or []:
                    call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                    if d.id is not None:
                        assert call["id"] is None  # id and name come once
                        call["id"] = d.id
                    if d.function and d.function.name is not None:
                        assert call["name"] is None
                        call["name"] = d.function.name
                    if d.function and d.function.arguments:
                        call["arguments"] += d.function.arguments
        assert finish == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == [
            (c.function.name, json.loads(c.function.arguments)) for c in whole
        ]


@pytest.mark.slow
def test_tool_result_round_trip_and_n2(client):
    tools = gen_tools(7)
    kw = dict(model="m", tools=tools, tool_choice="required", max_tokens=MAX_TOKENS, parallel_tool_calls=False)
    r = client.chat.completions.create(messages=MSGS, temperature=0, **kw)
    call = check_calls(r.choices[0], tools)[0]
    round2 = MSGS + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "result: 42"},
    ]
    r2 = client.chat.completions.create(messages=round2, temperature=0, **kw)
    check_calls(r2.choices[0], tools)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens
    r3 = client.chat.completions.create(messages=round2, n=2, temperature=1.0, seed=3, **kw)
    assert sorted(c.index for c in r3.choices) == [0, 1]
    for c in r3.choices:
        check_calls(c, tools)


def test_parallel_calls_are_each_valid(client):
    tools = gen_tools(1)
    r = client.chat.completions.create(
        model="m", messages=MSGS, tools=tools, tool_choice="required", max_tokens=MAX_TOKENS, temperature=1.0, seed=11
    )
    if r.choices[0].finish_reason != "length":  # random weights may chain calls until max_tokens
        check_calls(r.choices[0], tools)


def test_short_max_tokens_ends_with_length(client):
    tools = gen_tools(2)
    r = client.chat.completions.create(
        model="m", messages=MSGS, tools=tools, tool_choice="required", max_tokens=3, temperature=0
    )
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls


def test_required_with_another_constraint_is_refused(client):
    tools = gen_tools(0)
    for extra in ({"response_format": {"type": "json_object"}}, {"extra_body": {"guided_regex": "a+"}}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model="m", messages=MSGS, tools=tools, tool_choice="required", max_tokens=8, **extra
            )
        assert e.value.body["param"] == "tool_choice"
        assert ("response_format" if "response_format" in extra else "guided_regex") in e.value.body["message"]
