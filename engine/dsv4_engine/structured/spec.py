"""What a request constrains its output to: one kind and one text, plain data.

Torch-free and grammar-engine-free: the HTTP process builds and checks these (cheaply: a schema
is JSON of the right shape, a choice is non-empty), sends them to the engine core inside
`SamplingParams`, and the core compiles them (`dsv4_engine.structured.grammar`), where a
grammar the engine cannot compile ends the request with a 400 before any compute.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterator, Union

from dsv4_wire.chat_names import TOOL_CALL_FORMATS, canonical

# json_object: any JSON object; json_schema: a JSON Schema (JSON text); regex: a regular
# expression the whole output matches; choice: a JSON list of strings, the output is one of them;
# ebnf: xgrammar's EBNF (GBNF-like) grammar text; structural_tag: xgrammar's structural tag (JSON
# text); tool_calls: the model's native tool-call text for `tool_choice` "required" or a named
# function, free text with at most one well-formed call block for "auto" (JSON: {parser, tools, tool_choice, parallel_tool_calls, thinking}; the engine builds
# the grammar, `dsv4_engine.structured.tool_calls`).
KINDS = ("json_object", "json_schema", "regex", "choice", "ebnf", "structural_tag", "tool_calls")
MAX_SPEC_CHARS = 1 << 20  # a constraint's text, at most (1 MiB; a schema bigger than that is abuse)
# Grammar text (EBNF, regex) at most: compile time grows faster than its size (issue 39: 12,000
# rules took 18 s), so its bound is far below a schema's.
MAX_GRAMMAR_CHARS = 64 * 1024
# A repeat count ({n,m} in a regex or EBNF, a schema's length/item/property bounds) at most.
MAX_REPEAT = 65536
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_SCHEMA_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


def _schema_counts(v: Any) -> Iterator[tuple[str, Any]]:
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            for k, item in x.items():
                if k in _SCHEMA_COUNTS:
                    yield k, item
                if isinstance(item, (dict, list)):
                    stack.append(item)
        elif isinstance(x, list):
            stack.extend(i for i in x if isinstance(i, (dict, list)))


def _check_bounds(kind: str, value: str, parsed: Any = None) -> None:
    if kind in ("regex", "ebnf"):
        if len(value) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"{kind}: the grammar is longer than {MAX_GRAMMAR_CHARS} characters")
        for m in _REPEAT.finditer(value):
            if any(n and int(n) > MAX_REPEAT for n in m.groups()):
                raise ValueError(f"{kind}: the repeat count {m.group(0)} is over {MAX_REPEAT}")
    if kind == "json_schema":
        for k, n in _schema_counts(parsed):
            if isinstance(n, (int, float)) and not isinstance(n, bool) and n > MAX_REPEAT:
                raise ValueError(f"json_schema: {k} {n} is over {MAX_REPEAT}")


@dataclass(frozen=True)
class StructuredSpec:
    kind: str
    value: str = ""  # the constraint as text (JSON text for json_schema, choice and structural_tag)

    def check(self) -> None:
        """Raise ValueError naming the problem of a spec the engine could never compile. Only
        cheap checks: the grammar engine itself (in the core) has the last word."""
        if self.kind not in KINDS:
            raise ValueError(f"unknown structured output kind {self.kind!r} (one of {', '.join(KINDS)})")
        if not isinstance(self.value, str):
            raise ValueError(f"{self.kind}: the constraint must be text")
        if len(self.value) > MAX_SPEC_CHARS:
            raise ValueError(f"{self.kind}: the constraint is longer than {MAX_SPEC_CHARS} characters")
        if self.kind == "json_object":
            return
        if not self.value.strip():
            raise ValueError(f"{self.kind}: the constraint is empty")
        _check_bounds(self.kind, self.value)
        if self.kind in ("json_schema", "choice", "structural_tag", "tool_calls"):
            try:
                v = json.loads(self.value)
            except ValueError as e:
                raise ValueError(f"{self.kind}: not valid JSON ({e})") from None
            if self.kind == "json_schema" and not isinstance(v, (dict, bool)):
                raise ValueError("json_schema: a JSON Schema is an object (or true/false)")
            _check_bounds(self.kind, self.value, v)
            if self.kind == "choice" and (not isinstance(v, list) or not v or not all(isinstance(c, str) for c in v)):
                raise ValueError("choice: a non-empty list of strings is required")
            if self.kind == "structural_tag" and not isinstance(v, dict):
                raise ValueError("structural_tag: a JSON object is required")
            if self.kind == "tool_calls":
                _check_tool_calls(v)

    def row(self) -> tuple[str, str]:
        """The spec as plain values (the core messages are marshalled)."""
        return (self.kind, self.value)

    @classmethod
    def of_row(cls, row: Any) -> "StructuredSpec":
        kind, value = row
        return cls(kind, value)


def json_schema(schema: Any) -> StructuredSpec:
    """A spec for a schema given as a parsed JSON value (dict/bool) or as JSON text. Keys keep
    their order: the order of `properties` is the order the fields are generated in."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"json_schema: not valid JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError("json_schema: a JSON Schema is an object (or true/false)")
    return StructuredSpec("json_schema", json.dumps(schema, ensure_ascii=False))


def choice(options: Any) -> StructuredSpec:
    if not isinstance(options, list) or not options or not all(isinstance(c, str) for c in options):
        raise ValueError("choice: a non-empty list of strings is required")
    return StructuredSpec("choice", json.dumps(options, ensure_ascii=False))


def _check_tool_calls(v: Any) -> None:
    if not isinstance(v, dict):
        raise ValueError("tool_calls: a JSON object is required")
    parser = v.get("parser")
    if not isinstance(parser, str) or canonical(parser) not in TOOL_CALL_FORMATS:
        raise ValueError(
            f"tool_calls: no tool-call grammar for parser {parser!r} (one of {', '.join(TOOL_CALL_FORMATS)})"
        )
    tools = v.get("tools")
    if not isinstance(tools, list) or not tools:
        raise ValueError("tool_calls: a non-empty list of tools is required")
    names = []
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError("tool_calls: every tool needs function.name")
        if not isinstance(fn.get("parameters", {}), (dict, type(None))):
            raise ValueError(f"tool_calls: {fn['name']}: parameters must be a JSON Schema object")
        names.append(fn["name"])
    choice = v.get("tool_choice")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if name not in names:
            raise ValueError(f"tool_calls: tool_choice names {name!r}, which is not among the tools")
    elif choice not in ("required", "auto"):
        raise ValueError(f'tool_calls: tool_choice must be "required", "auto" or a named function, not {choice!r}')
    for key in ("parallel_tool_calls", "thinking"):
        if not isinstance(v.get(key, False), bool):
            raise ValueError(f"tool_calls: {key} must be true or false")


def tool_calls(
    parser: str,
    tools: list[dict],
    tool_choice: Union[str, dict],
    parallel_tool_calls: bool = True,
    thinking: bool = False,
) -> StructuredSpec:
    """A spec constraining the output to the model's native tool-call text (`parser`'s format):
    one call, or with `parallel_tool_calls` one or more, to the allowed tools (`tool_choice`
    "required": any of `tools`; {"type": "function", "function": {"name": N}}: N only), with
    arguments valid under each tool's parameters schema; after the reasoning when `thinking`."""
    value = {
        "parser": canonical(parser),
        "tools": tools,
        "tool_choice": tool_choice,
        "parallel_tool_calls": bool(parallel_tool_calls),
        "thinking": bool(thinking),
    }
    spec = StructuredSpec("tool_calls", json.dumps(value, ensure_ascii=False))
    spec.check()
    return spec
