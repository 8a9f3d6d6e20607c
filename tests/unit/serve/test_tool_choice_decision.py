"""tool_choice -> the answer's constraint (pure): auto is constrained by default, yields to the
request's own constraint and to the server's raw-model flag; forced choices keep their 400s."""

from __future__ import annotations

import json

import pytest

from dsv4_serve.chat.tool_choice import tool_choice_spec
from dsv4_wire import APIError

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


def test_auto_and_default_are_constrained_unless_turned_off_or_overridden():
    for choice in ("auto", None):
        spec = tool_choice_spec("deepseek_v4", TOOLS, choice, True, False, [])
        assert spec.kind == "tool_calls" and json.loads(spec.value)["tool_choice"] == "auto"
    assert tool_choice_spec("deepseek_v4", TOOLS, "auto", True, False, [], auto_grammar=False) is None
    assert tool_choice_spec("deepseek_v4", TOOLS, "auto", True, False, ["response_format"]) is None
    assert tool_choice_spec(None, TOOLS, "auto", True, False, []) is None  # no format to hold it to
    assert tool_choice_spec("deepseek_v4", [], "auto", True, False, []) is None
    assert tool_choice_spec("deepseek_v4", TOOLS, "none", True, False, []) is None


def test_forced_choices():
    spec = tool_choice_spec("deepseek_v31", TOOLS, "required", False, True, [])
    v = json.loads(spec.value)
    assert (v["tool_choice"], v["parallel_tool_calls"], v["thinking"]) == ("required", False, True)
    named = {"type": "function", "function": {"name": "f"}}
    assert json.loads(tool_choice_spec("deepseek_v31", TOOLS, named, True, False, []).value)["tool_choice"] == named
    with pytest.raises(APIError, match="cannot be combined with response_format"):
        tool_choice_spec("deepseek_v31", TOOLS, "required", True, False, ["response_format"])
    with pytest.raises(APIError, match="needs a tool-call format"):
        tool_choice_spec(None, TOOLS, named, True, False, [])
