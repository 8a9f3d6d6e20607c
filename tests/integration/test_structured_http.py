"""Structured outputs through `dsv4 serve` on a random-weight tiny checkpoint, with the official
`openai` client: response_format json_schema (chat and completions, streamed or not) yields
schema-valid JSON; vLLM's guided_regex / guided_choice / structured_outputs extras hold; an
invalid or unsupported constraint is a 400 naming the problem, streamed requests included."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from bench.harness.commands import Proc, free_port

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(tiny_model, tmp_path_factory):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = Proc(
        ["serve", "--model", tiny_model, "--port", port, "--kv-pages", 128, "--served-model-name", "m"],
        tmp_path_factory.mktemp("structured") / "serve.log",
    )
    try:
        proc.wait_ready(url)
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    finally:
        proc.stop()


def _json_schema_format(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_chat_json_schema_is_valid_streamed_or_not(client):
    msgs = [{"role": "user", "content": "who?"}]
    r = client.chat.completions.create(
        model="m", messages=msgs, max_tokens=120, temperature=0.8, seed=1, response_format=_json_schema_format()
    )
    assert r.choices[0].finish_reason == "stop", r
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    text, finish = "", None
    for chunk in client.chat.completions.create(
        model="m", messages=msgs, max_tokens=120, temperature=0, stream=True, response_format=_json_schema_format()
    ):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_completion_extras_regex_choice_and_json(client):
    r = client.completions.create(
        model="m",
        prompt="code:",
        max_tokens=40,
        temperature=1.0,
        seed=3,
        extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{3}"},
    )
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = client.completions.create(
        model="m",
        prompt="pick:",
        max_tokens=40,
        temperature=1.0,
        seed=4,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
    )
    assert r.choices[0].text in ("red", "green", "blue")
    r = client.completions.create(
        model="m", prompt="json:", max_tokens=120, temperature=0, extra_body={"guided_json": SCHEMA}
    )
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


def test_max_tokens_mid_json_ends_with_length(client):
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        temperature=0,
        response_format=_json_schema_format(),
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "body, words",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nosuch"}}}},
            ["nosuch"],
        ),  # compiled (and refused) in the engine core
        ({"guided_regex": "(["}, ["regex", "["]),
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, ["undefined_rule"]),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            ["response_format.json_schema.schema"],
        ),
        ({"guided_json": "{not json"}, ["guided_json", "JSON"]),
        ({"guided_choice": []}, ["guided_choice"]),
        ({"response_format": {"type": "yaml"}}, ["yaml"]),
        ({"guided_regex": "a", "guided_choice": ["a"]}, ["only one", "guided_regex", "guided_choice"]),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, ["whitespace_pattern"]),
    ],
)
def test_bad_constraint_is_a_400_naming_it(client, body, words, stream):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], max_tokens=8, stream=stream, extra_body=body
        )
    assert e.value.status_code == 400
    message = e.value.body["message"] if isinstance(e.value.body, dict) else str(e.value)
    for w in words:
        assert w in message, message
