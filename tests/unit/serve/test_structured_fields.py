"""The structured-output request fields (torch-free, as the HTTP process runs them): OpenAI's
response_format, vLLM's structured_outputs and guided_* extras each become one StructuredSpec;
every malformed, refused or doubled constraint is a 400 whose param names the field."""

from __future__ import annotations

import json

import pytest

from dsv4_engine.structured.spec import StructuredSpec
from dsv4_serve.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from dsv4_wire.errors import APIError

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["b"]}


def spec_of(body: dict, model=CompletionRequest):
    req = parse_request(
        model, json.dumps({"prompt": "x", "messages": [{"role": "user", "content": "x"}], **body}).encode()
    )
    return req.sampling_params(16).structured


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
@pytest.mark.parametrize(
    "body, want",
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredSpec("json_object")),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredSpec("json_schema", json.dumps(SCHEMA)),
        ),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredSpec("json_schema", json.dumps(SCHEMA))),
        ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredSpec("regex", "[a-z]+")),
        ({"structured_outputs": {"choice": ["y", "n"]}}, StructuredSpec("choice", '["y", "n"]')),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredSpec("ebnf", 'root ::= "a"')),
        ({"structured_outputs": {"json_object": True}}, StructuredSpec("json_object")),
        (
            {"structured_outputs": {"structural_tag": '{"type": "structural_tag"}'}},
            StructuredSpec("structural_tag", '{"type": "structural_tag"}'),
        ),
        (
            {"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"},
            StructuredSpec("json_schema", json.dumps(SCHEMA)),
        ),
        ({"guided_regex": "a|b"}, StructuredSpec("regex", "a|b")),
        ({"guided_choice": ["é", '"q"']}, StructuredSpec("choice", '["é", "\\"q\\""]')),
        ({"guided_grammar": 'root ::= "a"'}, StructuredSpec("ebnf", 'root ::= "a"')),
    ],
)
def test_each_field_becomes_one_spec(body, want, model):
    assert spec_of(body, model) == want


def test_the_schemas_property_order_is_kept():
    assert list(json.loads(spec_of({"guided_json": SCHEMA}).value)["properties"]) == ["b", "a"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": [1]}}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"guided_json": "{nope"}, "guided_json"),
        ({"guided_json": "[1, 2]"}, "guided_json"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_grammar": "  "}, "guided_grammar"),
        ({"structured_outputs": {"structural_tag": "[]"}}, "structured_outputs.structural_tag"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " *"}}, "structured_outputs.whitespace_pattern"),
        (
            {"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}},
            "structured_outputs.disable_additional_properties",
        ),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ],
)
def test_bad_or_doubled_constraints_are_400s_naming_the_field(body, param):
    with pytest.raises(APIError) as e:
        spec_of(body)
    assert e.value.status == 400 and (e.value.param or "").startswith(param), (e.value.param, e.value.message)
