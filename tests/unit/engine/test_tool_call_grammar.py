"""tool_call_grammar: compiled by xgrammar against a tiny checkpoint's tokenizer, it accepts the
native tool-call texts our parsers read (tokenised as the engine would) and rejects malformed
ones: unknown or not-chosen tools, missing required arguments, wrong types, a second call when
parallel calls are off."""

from __future__ import annotations

import json

import pytest

from dsv4_serve.chat.output import ChatOutput
from dsv4_serve.chat.registry import tool_parser
from dsv4_wire import chat_tokens as T

xgr = pytest.importorskip("xgrammar")

D = T.DSML
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer", "minimum": 1},
                    "unit": {"type": "string", "enum": ["C", "F"]},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]


def v31(*calls):
    return (
        T.TOOL_CALLS_BEGIN
        + "".join(f"{T.TOOL_CALL_BEGIN}{n}{T.TOOL_SEP}{json.dumps(a)}{T.TOOL_CALL_END}" for n, a in calls)
        + T.TOOL_CALLS_END
    )


def v3(*calls):
    return (
        T.TOOL_CALLS_BEGIN
        + "\n".join(
            f"{T.TOOL_CALL_BEGIN}function{T.TOOL_SEP}{n}\n```json\n{json.dumps(a)}\n```{T.TOOL_CALL_END}"
            for n, a in calls
        )
        + T.TOOL_CALLS_END
    )


def dsml(block):
    def make(*calls):
        invokes = []
        for name, args in calls:
            params = "\n".join(
                f'<{D}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
                f"{v if isinstance(v, str) else json.dumps(v)}</{D}parameter>"
                for k, v in args.items()
            )
            invokes.append(f'<{D}invoke name="{name}">\n{params}\n</{D}invoke>')
        return f"\n\n<{D}{block}>\n" + "\n".join(invokes) + f"\n</{D}{block}>"

    return make


FORMATS = {
    "deepseek_v31": v31,
    "deepseek_v3": v3,
    "deepseek_v4": dsml("tool_calls"),
    "deepseek_v32": dsml("function_calls"),
}
GOOD = [
    [("get_weather", {"city": "Paris"})],
    [("get_weather", {"city": "Paris <b>", "days": 3, "unit": "F"})],
    [("now", {})],
    [("get_weather", {"city": "Rome"}), ("now", {})],  # parallel
]
BAD = [
    [("get_time", {})],  # no such tool
    [("get_weather", {"days": 3})],  # required city missing
    [("get_weather", {"city": "Paris", "days": "three"})],  # wrong type
    [("get_weather", {"city": "Paris", "unit": "K"})],  # not in the enum
    [("get_weather", {"city": "Paris", "days": 0})],  # below the minimum
]


@pytest.fixture(scope="module")
def compiler_and_tok(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from dsv4_engine.checkpoint import tokenizer_config, train_tokenizer
    from dsv4_engine.tokenizer import Tokenizer

    d = tmp_path_factory.mktemp("tok")
    (d / "tokenizer.json").write_text(train_tokenizer().to_str(), encoding="utf-8")
    (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(4096)), encoding="utf-8")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(d / "tokenizer.json"), eos_token=T.EOS, bos_token=T.BOS
    )
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=512)
    return xgr.GrammarCompiler(info), Tokenizer.from_dir(d)


def accepts(compiled, tok, text: str) -> bool:
    m = xgr.GrammarMatcher(compiled)
    for t in tok.encode_pieces([(text, True)]):  # the model's own tokens: markers are single tokens
        if not m.accept_token(t):
            return False
    return m.accept_token(tok.eos_ids[0]) and m.is_terminated()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_grammar_accepts_parsed_calls_and_rejects_malformed(compiler_and_tok, fmt):
    from dsv4_engine.structured.tool_calls import tool_call_grammar

    compiler, tok = compiler_and_tok
    make = FORMATS[fmt]
    required = compiler.compile_grammar(xgr.Grammar.from_ebnf(tool_call_grammar(fmt, TOOLS, "required")))
    single = compiler.compile_grammar(xgr.Grammar.from_ebnf(tool_call_grammar(fmt, TOOLS, "required", False)))
    named = compiler.compile_grammar(
        xgr.Grammar.from_ebnf(tool_call_grammar(fmt, TOOLS, {"type": "function", "function": {"name": "now"}}))
    )
    for calls in GOOD:
        text = make(*calls)
        parsed = tool_parser(fmt).parse(text)
        assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls  # our parser reads it
        assert accepts(required, tok, text), (fmt, calls)
        assert accepts(single, tok, text) is (len(calls) == 1)
        assert accepts(named, tok, text) is all(n == "now" for n, _ in calls)
    for calls in BAD:
        assert not accepts(required, tok, make(*calls)), (fmt, calls)
    assert not accepts(required, tok, "Sure, let me check.")
    assert not accepts(required, tok, make(*GOOD[0])[:-3])  # cut off


def test_unknown_parser_or_tool_refused():
    from dsv4_engine.structured.tool_calls import tool_call_grammar

    with pytest.raises(ValueError):
        tool_call_grammar("hermes", TOOLS)
    with pytest.raises(ValueError):
        tool_call_grammar("deepseek_v4", TOOLS, {"type": "function", "function": {"name": "nope"}})


def test_thinking_prefix(compiler_and_tok):
    from dsv4_engine.structured.tool_calls import tool_call_grammar

    compiler, tok = compiler_and_tok
    g = compiler.compile_grammar(xgr.Grammar.from_ebnf(tool_call_grammar("deepseek_v4", TOOLS, thinking=True)))
    call = dsml("tool_calls")(*GOOD[0])
    assert accepts(g, tok, f"I need the weather, 2 < 3.{T.THINK_END}{call}")
    assert accepts(g, tok, f"{T.THINK_END}{call}")
    assert not accepts(g, tok, call)  # the reasoning must be closed first
    parsed = ChatOutput(tool_parser("deepseek_v4"), True).message(f"why{T.THINK_END}{call}")
    assert parsed["reasoning_content"] == "why" and parsed["tool_calls"][0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("fmt", ["deepseek_v3", "deepseek_v31"])
def test_a_marker_cannot_open_inside_a_json_argument_string(compiler_and_tok, fmt):
    """The call's end marker written inside an argument string (what a weak model did: the string
    never closed and the answer ran to max_tokens) is refused; escapes, quotes and newlines in
    argument text still pass."""
    from dsv4_engine.structured.tool_calls import tool_call_grammar

    compiler, tok = compiler_and_tok
    g = compiler.compile_grammar(xgr.Grammar.from_ebnf(tool_call_grammar(fmt, TOOLS, "required")))
    make = FORMATS[fmt]
    assert accepts(g, tok, make(("get_weather", {"city": 'line 1\nline "2" \\ tab\t'})))
    for marker in (T.TOOL_CALL_END, T.TOOL_CALLS_END, T.TOOL_SEP):
        raw = make(("get_weather", {"city": "PaXXris"})).replace("XX", marker)  # as the model writes it, unescaped
        assert not accepts(g, tok, raw), marker
    # and at the mask: inside the string, the marker's token is not among the allowed ones
    m = xgr.GrammarMatcher(g)
    prefix = make(("get_weather", {"city": "Pa"}))
    prefix = prefix[: prefix.index('"Pa') + 3]
    for t in tok.encode_pieces([(prefix, True)]):
        assert m.accept_token(t)
    end_id = tok.encode_pieces([(T.TOOL_CALL_END, True)])
    assert len(end_id) == 1 and not m.accept_token(end_id[0])
