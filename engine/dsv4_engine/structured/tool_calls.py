"""The grammar of a model's native tool-call text, for `tool_choice: "required"` or a named
function: compiled for a `tool_calls` spec (`dsv4_engine.structured.spec.tool_calls`), it makes
even a weak model answer with a call the HTTP process's parser reads, to an allowed tool, with
arguments valid under the tool's JSON schema.

Imports xgrammar (which imports torch): the engine core only, never the HTTP process.
"""

from __future__ import annotations

import json
from typing import Optional, Union

from dsv4_engine.structured.schema import strings_without
from dsv4_wire import chat_tokens as T
from dsv4_wire.chat_names import canonical

_JSON_SEPARATORS = (", ", ": ")  # the spacing json.dumps writes, as the renderers do


def _lit(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _allowed(tools: list[dict], tool_choice: Union[str, dict, None]) -> list[dict]:
    fns = [t["function"] for t in tools]
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        fns = [f for f in fns if f.get("name") == name]
        if not fns:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    elif tool_choice not in (None, "required", "auto"):
        raise ValueError(f"no grammar for tool_choice {tool_choice!r}")
    if not fns:
        raise ValueError("a tool-call grammar needs at least one tool")
    return fns


def tool_call_grammar(
    parser_name: str,
    tools: list[dict],
    tool_choice: Union[str, dict, None] = "required",
    parallel_tool_calls: bool = True,
    thinking: bool = False,
) -> str:
    """An xgrammar EBNF grammar (root rule `root`; load it with `xgrammar.Grammar.from_ebnf`) that
    admits exactly the model's native text for one call — or, with `parallel_tool_calls`, one or
    more — to the allowed tools (`tool_choice` "required": any of `tools`; {"type": "function",
    "function": {"name": N}}: only N), with arguments valid under each tool's `parameters` schema.

    Arguments are JSON with json.dumps' spacing (V3/V3.1), or DSML parameters in the schema's
    property order with the required ones present (V3.2/V4: string properties raw, without "</",
    the others as JSON). The text is the whole answer: no prose before the block. With
    `thinking` (the prompt opened `<think>`), reasoning comes first, up to `</think>`; it may not
    contain `</` itself (EBNF has no "any text but this string")."""
    import xgrammar as xg

    grammar = _tool_call_grammar(xg, parser_name, tools, tool_choice, parallel_tool_calls)
    if not thinking:
        return str(grammar)
    reasoning = xg.Grammar.from_ebnf(f'root ::= ([^<] | "<" [^/])* {_lit(T.THINK_END)}')
    return str(xg.Grammar.concat(reasoning, grammar))


def _block_parts(xg, parser_name: str, tools: list[dict], tool_choice, parallel_tool_calls: bool):
    """(begin, calls, end): the block's opening marker text, the grammar of the calls inside it
    (one, or with `parallel_tool_calls` one or more, separated as the format writes them), and
    its closing marker text."""
    fmt = canonical(parser_name)
    fns = _allowed(tools, tool_choice)

    def ebnf(body: str) -> "xg.Grammar":
        return xg.Grammar.from_ebnf(f"root ::= {body}")

    if fmt in ("deepseek_v3", "deepseek_v31"):
        calls = []
        for fn in fns:
            if fmt == "deepseek_v31":
                head = ebnf(_lit(f"{T.TOOL_CALL_BEGIN}{fn['name']}{T.TOOL_SEP}"))
                tail = ebnf(_lit(T.TOOL_CALL_END))
            else:
                head = ebnf(_lit(f"{T.TOOL_CALL_BEGIN}function{T.TOOL_SEP}{fn['name']}\n```json\n"))
                tail = ebnf(_lit(f"\n```{T.TOOL_CALL_END}"))
            calls.append(xg.Grammar.concat(head, _schema_json(xg, fn.get("parameters")), tail))
        call = xg.Grammar.union(*calls) if len(calls) > 1 else calls[0]
        sep = "\n" if fmt == "deepseek_v3" else ""
        return T.TOOL_CALLS_BEGIN, _repeat(xg, ebnf, call, sep, parallel_tool_calls), T.TOOL_CALLS_END
    if fmt in ("deepseek_v32", "deepseek_v4"):
        block = "function_calls" if fmt == "deepseek_v32" else "tool_calls"
        d = T.DSML
        calls = [
            xg.Grammar.concat(
                ebnf(_lit(f'<{d}invoke name="{fn["name"]}">\n')),
                _dsml_params(xg, ebnf, fn),
                ebnf(_lit(f"</{d}invoke>")),
            )
            for fn in fns
        ]
        call = xg.Grammar.union(*calls) if len(calls) > 1 else calls[0]
        body = xg.Grammar.concat(ebnf(_lit("\n")), _repeat(xg, ebnf, call, "\n", parallel_tool_calls), ebnf(_lit("\n")))
        return f"<{d}{block}>", body, f"</{d}{block}>"
    raise ValueError(f"no tool-call grammar for parser {parser_name!r}")


def _tool_call_grammar(xg, parser_name: str, tools: list[dict], tool_choice, parallel_tool_calls: bool):
    begin, calls, end = _block_parts(xg, parser_name, tools, tool_choice, parallel_tool_calls)
    if canonical(parser_name) in ("deepseek_v32", "deepseek_v4"):
        begin = "\n\n" + begin  # the encoder writes a blank line before the block
    return xg.Grammar.concat(
        xg.Grammar.from_ebnf(f"root ::= {_lit(begin)}"), calls, xg.Grammar.from_ebnf(f"root ::= {_lit(end)}")
    )


def _schema_json(xg, schema: Optional[dict]):
    schema = strings_without(schema, T.MARKER_BAR) if schema else {"type": "object"}
    return xg.Grammar.from_json_schema(
        json.dumps(schema), any_whitespace=False, separators=_JSON_SEPARATORS, strict_mode=True
    )


def _repeat(xg, ebnf, call, sep: str, parallel: bool):
    """call (sep call)*, or call alone."""
    if not parallel:
        return call
    more = xg.Grammar.concat(ebnf(_lit(sep)), call) if sep else call
    return xg.Grammar.concat(call, _star(xg, more))


def _star(xg, g):
    """g* as a grammar: xgrammar's combinators have no repetition, so spell it through EBNF with g's
    rules renamed by a round trip (str(concat) keeps them distinct)."""
    text = str(xg.Grammar.concat(g))
    # the root of `text` is g; add a repeating root over it
    renamed = text.replace("root ::=", "star_item ::=", 1)
    return xg.Grammar.from_ebnf(f"root ::= star_item*\n{renamed}")


def _dsml_params(xg, ebnf, fn: dict):
    """The parameters of one invoke, each followed by a newline; "\n" alone when there are none."""
    d = T.DSML
    schema = fn.get("parameters") or {}
    props: dict = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    items = []
    defs = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)}
    for name, sub in props.items():
        string, other = _string_split(_deref(sub if isinstance(sub, dict) else {}, schema), schema)
        forms = []
        if string is not None:  # a string value is written raw, as the encoder writes it
            forms.append(
                xg.Grammar.concat(ebnf(_lit(f'<{d}parameter name="{name}" string="true">')), _raw(xg, ebnf, string))
            )
        if other is not None:
            # each parameter is its own schema: it keeps the root's definitions, so a pydantic
            # `$ref: "#/$defs/Model"` inside it still resolves
            value = xg.Grammar.from_json_schema(
                json.dumps(strings_without({**other, **defs} if defs else other, T.MARKER_BAR)),
                any_whitespace=False,
                separators=_JSON_SEPARATORS,
                strict_mode=True,
            )
            forms.append(xg.Grammar.concat(ebnf(_lit(f'<{d}parameter name="{name}" string="false">')), value))
        form = xg.Grammar.union(*forms) if len(forms) > 1 else forms[0]
        item = xg.Grammar.concat(form, ebnf(_lit(f"</{d}parameter>\n")))
        items.append(item if name in required else xg.Grammar.union(item, ebnf('""')))
    if not items:
        return ebnf(_lit("\n"))
    seq = xg.Grammar.concat(*items) if len(items) > 1 else items[0]
    if required & set(props):
        return seq
    return xg.Grammar.union(seq, ebnf(_lit("\n")))  # every parameter optional: none at all is "\n"


def _string_split(sub: dict, root: dict) -> tuple[Optional[dict], Optional[dict]]:
    """(the parameter's string form, its other forms) as schemas, None where it has none. A
    string parameter is only a string; `anyOf`/`oneOf` with a string branch (pydantic's
    `Optional[str]`) and `type: ["string", "null"]` may be either: the encoder writes a string
    value raw (string="true") and anything else as JSON."""
    t = sub.get("type")
    if t == "string":
        return sub, None
    if isinstance(t, list) and "string" in t:
        rest = [x for x in t if x != "string"]
        return {**sub, "type": "string"}, ({**sub, "type": rest if len(rest) > 1 else rest[0]} if rest else None)
    for key in ("anyOf", "oneOf"):
        branches = sub.get(key)
        if isinstance(branches, list) and "type" not in sub:
            resolved = [_deref(b, root) if isinstance(b, dict) else {} for b in branches]
            strings = [b for b in resolved if b.get("type") == "string"]
            if strings:
                rest = [b for b, r in zip(branches, resolved) if r.get("type") != "string"]
                other = {k: v for k, v in sub.items() if k != key}
                return strings[0], ({**other, key: rest} if rest else None)
    return None, sub


def _raw(xg, ebnf, sub: dict):
    """A raw (string="true") parameter value: no "</" inside (it would end the parameter)."""
    if "enum" in sub:
        return ebnf("(" + " | ".join(_lit(str(v)) for v in sub["enum"]) + ")")
    if "const" in sub:
        return ebnf(_lit(str(sub["const"])))
    if "pattern" in sub:
        return xg.Grammar.from_regex(sub["pattern"])
    if "minLength" in sub or "maxLength" in sub:  # bounded: a weak model cannot run on for ever
        hi = sub.get("maxLength")
        return xg.Grammar.from_regex(f"[^<]{{{int(sub.get('minLength', 0))},{'' if hi is None else int(hi)}}}")
    return ebnf(r'([^<] | "<" [^/])*')


def _deref(sub: dict, root: dict) -> dict:
    """A parameter schema that is only a local `$ref` (pydantic writes enums and nested models
    so), replaced by what it points to, so the string/JSON choice sees the real type."""
    ref = sub.get("$ref")
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return sub
    target = root
    for part in ref[2:].split("/"):
        target = target.get(part) if isinstance(target, dict) else None
    if not isinstance(target, dict) or "$ref" in target:
        return sub
    return {**target, **{k: v for k, v in sub.items() if k != "$ref"}}


def auto_structural_tag(
    parser_name: str, tools: list[dict], parallel_tool_calls: bool = True, thinking: bool = False
) -> str:
    """xgrammar structural tag (JSON text) for `tool_choice: "auto"`: the answer is free text,
    then optionally one well-formed call block (the same grammar as "required"), and then only the
    end of the output. The free text never holds the full-width bar `｜`: every DeepSeek marker
    contains it, so no markup can start outside the block (and leak into `content`), while the
    block's own opening marker is where the bar may first appear. With `thinking`, the reasoning
    comes first, free but without the bar, up to `</think>` (the formats put calls after it); the
    output may also end inside it (a model that ran out of thoughts is not held to `max_tokens`)."""
    import xgrammar as xg

    fmt = canonical(parser_name)
    begin, calls, end = _block_parts(xg, fmt, tools, "auto", parallel_tool_calls)
    free = f"[^{T.MARKER_BAR}]*"
    block = xg.Grammar.concat(
        xg.Grammar.from_ebnf(f"root ::= {_lit(begin)}"), calls, xg.Grammar.from_ebnf(f"root ::= {_lit(end)}")
    )
    answer = xg.Grammar.concat(xg.Grammar.from_ebnf(f"root ::= {free}"), xg.Grammar.union(block, _empty(xg)))
    fmt_: dict = {"type": "grammar", "grammar": str(answer)}
    if thinking:
        reasoning = {
            "type": "tag",
            "begin": "",
            "content": {"type": "any_text", "excludes": [T.MARKER_BAR]},
            "end": T.THINK_END,
        }
        # or reasoning that never closes: the output may still end there (EOS), as without a grammar
        unclosed = {"type": "any_text", "excludes": [T.MARKER_BAR, T.THINK_END]}
        fmt_ = {"type": "or", "elements": [{"type": "sequence", "elements": [reasoning, fmt_]}, unclosed]}
    return json.dumps({"type": "structural_tag", "format": fmt_}, ensure_ascii=False)


def _empty(xg):
    return xg.Grammar.from_ebnf('root ::= ""')


def is_auto(value: str) -> bool:
    return json.loads(value).get("tool_choice") == "auto"


def spec_structural_tag(value: str) -> str:
    v = json.loads(value)
    return auto_structural_tag(
        v["parser"], v["tools"], bool(v.get("parallel_tool_calls", True)), bool(v.get("thinking", False))
    )


def spec_grammar(value: str) -> str:
    """The EBNF of a `tool_calls` spec's value (JSON: parser, tools, tool_choice,
    parallel_tool_calls, thinking; see `dsv4_engine.structured.spec.tool_calls`)."""
    v = json.loads(value)
    return tool_call_grammar(
        v["parser"],
        v["tools"],
        v["tool_choice"],
        bool(v.get("parallel_tool_calls", True)),
        bool(v.get("thinking", False)),
    )
