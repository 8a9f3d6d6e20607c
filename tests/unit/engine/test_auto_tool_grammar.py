"""`tool_choice: "auto"` grammar (a structural tag): free text, then at most one well-formed call
block of the given tools and nothing after it; the format's other markers never in the free
text; with thinking, reasoning first and no call inside it. Compiled against a tiny checkpoint's
tokenizer and fed the model's own tokens."""

from __future__ import annotations

import json

import pytest

from dsv4_engine.structured.tool_calls import auto_structural_tag
from dsv4_wire import chat_tokens as T

from tests.unit.engine.test_tool_call_grammar import BAD, FORMATS, GOOD, TOOLS, accepts, compiler_and_tok  # noqa: F401

xgr = pytest.importorskip("xgrammar")

PYDANTIC_NESTED = {  # what pydantic writes for a model with a nested model, an enum and an optional
    "$defs": {
        "Addr": {
            "properties": {
                "city": {"title": "City", "type": "string"},
                "zip": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
            },
            "required": ["city"],
            "title": "Addr",
            "type": "object",
            "additionalProperties": False,
        },
        "Kind": {"enum": ["home", "work"], "title": "Kind", "type": "string"},
    },
    "properties": {
        "name": {"title": "Name", "type": "string"},
        "kind": {"$ref": "#/$defs/Kind"},
        "addr": {"$ref": "#/$defs/Addr"},
        "more": {"default": [], "items": {"$ref": "#/$defs/Addr"}, "type": "array"},
    },
    "required": ["name", "kind", "addr"],
    "title": "User",
    "type": "object",
}


def compile_auto(compiler, fmt, tools=TOOLS, parallel=True, thinking=False):
    return compiler.compile_structural_tag(auto_structural_tag(fmt, tools, parallel, thinking))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_auto_free_text_then_one_good_block(compiler_and_tok, fmt):
    compiler, tok = compiler_and_tok
    g = compile_auto(compiler, fmt)
    make = FORMATS[fmt]
    assert accepts(g, tok, "Just an answer, no call.")
    assert accepts(g, tok, "")
    for calls in GOOD:
        assert accepts(g, tok, make(*calls)), calls
        assert accepts(g, tok, "Let me check." + make(*calls)), calls
    for calls in BAD:
        assert not accepts(g, tok, "Let me check." + make(*calls)), calls
    good = make(*GOOD[0])
    assert not accepts(g, tok, good + "more text")  # nothing after the block
    assert not accepts(g, tok, good + good)
    # a cut-off block cannot end the output
    assert not accepts(g, tok, good[: len(good) // 2])
    # markup outside a block is refused (it would leak into content)
    strays = [T.TOOL_SEP, T.TOOL_CALL_END] if fmt in ("deepseek_v3", "deepseek_v31") else [f"</{T.DSML}invoke>", T.DSML]
    for stray in strays:
        assert not accepts(g, tok, f"text {stray} text"), stray
    single = compile_auto(compiler, fmt, parallel=False)
    assert accepts(single, tok, make(*GOOD[0]))
    assert not accepts(single, tok, make(*GOOD[3]))


@pytest.mark.parametrize("fmt", ["deepseek_v31", "deepseek_v4"])
def test_auto_with_thinking(compiler_and_tok, fmt):
    compiler, tok = compiler_and_tok
    g = compile_auto(compiler, fmt, thinking=True)
    block = FORMATS[fmt](*GOOD[1])
    assert accepts(g, tok, f"I should call it.{T.THINK_END}" + block)
    assert accepts(g, tok, f"I should answer.{T.THINK_END}The answer.")
    assert not accepts(g, tok, "thinking" + block)  # no call inside the reasoning
    assert accepts(g, tok, "reasoning that never closed")  # may end there, as without a grammar


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_pydantic_nested_models_one_and_several_tools(compiler_and_tok, fmt):
    """instructor's TOOLS mode with a nested model: `$defs`/`$ref` still resolve once the
    parameters are split into DSML parameters (they used to be refused)."""
    from dsv4_engine.structured.tool_calls import tool_call_grammar

    compiler, tok = compiler_and_tok
    user = {"type": "function", "function": {"name": "User", "parameters": PYDANTIC_NESTED}}
    args = {
        "name": "Ann",
        "kind": "work",
        "addr": {"city": "Oslo", "zip": None},
        "more": [{"city": "Rome", "zip": "1"}],
    }
    for tools in ([user], [user, *TOOLS]):
        required = compiler.compile_grammar(tool_call_grammar(fmt, tools, "required"))
        auto = compile_auto(compiler, fmt, tools)
        text = FORMATS[fmt](("User", args))
        assert accepts(required, tok, text) and accepts(auto, tok, text)
        bad = FORMATS[fmt](("User", {**args, "kind": "school"}))
        assert not accepts(required, tok, bad)
        bad = FORMATS[fmt](("User", {**args, "addr": {"city": "Oslo", "extra": 1}}))
        assert not accepts(required, tok, bad)
    assert json.loads(json.dumps(PYDANTIC_NESTED)) == PYDANTIC_NESTED


def test_pydantic_nested_model_as_json_schema(compiler_and_tok):
    """`response_format: json_schema` with what pydantic writes for a nested model (instructor's
    JSON modes): compiled as the engine does, it takes a valid instance and refuses a bad one."""
    from dsv4_engine.structured.schema import length_strings_safe

    compiler, tok = compiler_and_tok
    g = compiler.compile_json_schema(
        json.dumps(length_strings_safe(PYDANTIC_NESTED)), any_whitespace=False, strict_mode=True
    )
    good = {"name": "Ann", "kind": "home", "addr": {"city": "Oslo", "zip": None}, "more": []}
    assert accepts(g, tok, json.dumps(good))
    assert not accepts(g, tok, json.dumps({**good, "kind": "school"}))


@pytest.mark.parametrize("fmt", ["deepseek_v4", "deepseek_v32"])
def test_dsml_optional_string_may_be_raw_or_null(compiler_and_tok, fmt):
    """pydantic's `Optional[str]` (anyOf string/null) and `type: ["string", "null"]`: a string is
    written raw (string="true"), as DeepSeek's encoder writes it, and null as JSON."""
    from dsv4_engine.structured.tool_calls import tool_call_grammar

    compiler, tok = compiler_and_tok
    d = T.DSML
    block = "tool_calls" if fmt == "deepseek_v4" else "function_calls"
    for sub in (
        {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}], "default": None},
        {"type": ["string", "null"]},
    ):
        tools = [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {"type": "object", "properties": {"q": sub}, "required": ["q"]},
                },
            }
        ]
        g = compiler.compile_grammar(tool_call_grammar(fmt, tools, "required"))

        def call(kind, value):
            return (
                f'\n\n<{d}{block}>\n<{d}invoke name="f">\n<{d}parameter name="q" string="{kind}">{value}'
                f"</{d}parameter>\n</{d}invoke>\n</{d}{block}>"
            )

        assert accepts(g, tok, call("true", "Paris"))
        assert accepts(g, tok, call("false", "null"))
        assert not accepts(g, tok, call("false", "5"))


def test_markers_a_tokenizer_calls_special_are_still_grammar_text():
    """A checkpoint whose tokenizer marks DeepSeek's chat markers special: the grammars are made
    of them, so the engine's token table keeps their text (else no call could ever be made)."""
    from tokenizers import Tokenizer as HFTokenizer

    from dsv4_engine.checkpoint import train_tokenizer
    from dsv4_engine.structured.grammar import tokenizer_info
    from dsv4_engine.structured.tool_calls import tool_call_grammar

    raw = json.loads(train_tokenizer().to_str())
    for t in raw["added_tokens"]:
        if t["content"] in T.CHAT_ADDED_TOKENS:
            t["special"] = True
    backend = HFTokenizer.from_str(json.dumps(raw))
    eos = backend.token_to_id(T.EOS)
    compiler = xgr.GrammarCompiler(tokenizer_info(backend, 512, [eos]))
    g = compiler.compile_grammar(tool_call_grammar("deepseek_v31", TOOLS, "required"))
    m = xgr.GrammarMatcher(g)
    text = FORMATS["deepseek_v31"](*GOOD[0])
    assert all(m.accept_token(t) for t in backend.encode(text, add_special_tokens=False).ids) and m.accept_token(eos)
