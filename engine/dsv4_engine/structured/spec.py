"""What a request constrains its output to: one kind and one text, plain data.

Torch-free and grammar-engine-free: the HTTP process builds and checks these (cheaply: a schema
is JSON of the right shape, a choice is non-empty), sends them to the engine core inside
`SamplingParams`, and the core compiles them (`dsv4_engine.structured.grammar`), where a
grammar the engine cannot compile ends the request with a 400 before any compute.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# json_object: any JSON object; json_schema: a JSON Schema (JSON text); regex: a regular
# expression the whole output matches; choice: a JSON list of strings, the output is one of them;
# ebnf: xgrammar's EBNF (GBNF-like) grammar text; structural_tag: xgrammar's structural tag (JSON
# text), the form tool-call grammars take.
KINDS = ("json_object", "json_schema", "regex", "choice", "ebnf", "structural_tag")
MAX_SPEC_CHARS = 1 << 20  # a constraint's text, at most (1 MiB; a schema bigger than that is abuse)


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
        if self.kind in ("json_schema", "choice", "structural_tag"):
            try:
                v = json.loads(self.value)
            except ValueError as e:
                raise ValueError(f"{self.kind}: not valid JSON ({e})") from None
            if self.kind == "json_schema" and not isinstance(v, (dict, bool)):
                raise ValueError("json_schema: a JSON Schema is an object (or true/false)")
            if self.kind == "choice" and (not isinstance(v, list) or not v or not all(isinstance(c, str) for c in v)):
                raise ValueError("choice: a non-empty list of strings is required")
            if self.kind == "structural_tag" and not isinstance(v, dict):
                raise ValueError("structural_tag: a JSON object is required")

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
