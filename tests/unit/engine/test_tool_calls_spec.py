"""The `tool_calls` spec kind: cheap checks in the HTTP process (torch-free), the grammar built
and compiled once per spec in the engine's GrammarCompiler."""

from __future__ import annotations

import json

import pytest

from dsv4_engine.structured.spec import StructuredSpec, tool_calls

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
        },
    }
]


def test_builder_canonicalises_and_checks():
    s = tool_calls("deepseekv31", TOOLS, "required")
    v = json.loads(s.value)
    assert s.kind == "tool_calls" and v["parser"] == "deepseek_v31" and v["parallel_tool_calls"] is True
    assert (
        tool_calls("deepseek-v4", TOOLS, {"type": "function", "function": {"name": "f"}}, False, True).kind
        == "tool_calls"
    )
    for bad in [
        dict(parser="hermes", tools=TOOLS, tool_choice="required"),
        dict(parser="deepseek_v4", tools=[], tool_choice="required"),
        dict(parser="deepseek_v4", tools=TOOLS, tool_choice="none"),
        dict(parser="deepseek_v4", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}}),
        dict(parser="deepseek_v4", tools=[{"function": {}}], tool_choice="required"),
    ]:
        with pytest.raises(ValueError, match="tool_calls"):
            tool_calls(**bad)
    with pytest.raises(ValueError, match="tool_calls"):
        StructuredSpec("tool_calls", "[1]").check()


def test_engine_compiles_and_caches(tmp_path):
    pytest.importorskip("xgrammar")
    from dsv4_engine.checkpoint import tokenizer_config, train_tokenizer
    from dsv4_engine.structured.grammar import GrammarError, Matcher, new_compiler
    from dsv4_engine.tokenizer import Tokenizer
    from dsv4_wire import chat_tokens as T

    (tmp_path / "tokenizer.json").write_text(train_tokenizer().to_str(), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(4096)), encoding="utf-8")
    tok = Tokenizer.from_dir(tmp_path)
    gc = new_compiler(tok.backend, 512, tok.eos_ids)
    spec = tool_calls("deepseek_v31", TOOLS, "required", False)
    compiled = gc.compile(spec)
    assert gc.compile(tool_calls("deepseek_v31", TOOLS, "required", False)) is compiled and gc.hits == 1
    m = Matcher(compiled)
    text = (
        f"{T.TOOL_CALLS_BEGIN}{T.TOOL_CALL_BEGIN}f{T.TOOL_SEP}{json.dumps({'x': 3})}{T.TOOL_CALL_END}{T.TOOL_CALLS_END}"
    )
    m.sync(tok.encode_pieces([(text, True)]) + [tok.eos_ids[0]])
    assert m.terminated
    with pytest.raises(GrammarError, match="tool_calls"):  # a schema xgrammar refuses: a 400 at admission
        gc.compile(
            tool_calls(
                "deepseek_v31",
                [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"x": {"type": "string", "pattern": "(["}}},
                        },
                    }
                ],
                "required",
            )
        )
