"""Models are compositions of layers that talk through public methods: no module of the model
folders reaches into another object's private names (`obj._name`), as MTP and the verify step
once called a dozen of the V4 model's private methods. A class's own (`self._x`, `cls._x`) is
its business. Allowlist an access only with why it cannot be public."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
FOLDERS = ("models", "layers", "spec_decode")
PRIVATE = re.compile(r"^_[a-z]")
ALLOWED: dict[str, str] = {}  # "folder/file.py:expr" -> why


def reaches(source: str) -> list[str]:
    """`value._name` accesses whose value is not self or cls (as source text)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and PRIVATE.match(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                out.append(f"{ast.unparse(node)} (line {node.lineno})")
    return out


def test_reaches_finds_another_objects_private_method() -> None:
    assert sorted(reaches("m._hc(x)\nself._own(x)\ncls._own\nm.public(x)\nself.tp._rank")) == [
        "m._hc (line 1)",
        "self.tp._rank (line 5)",
    ]


def test_no_module_of_the_model_folders_reaches_into_another_objects_privates() -> None:
    bad = []
    for folder in FOLDERS:
        for p in sorted((REPO / "engine" / "dsv4_engine" / folder).rglob("*.py")):
            rel = f"{folder}/{p.relative_to(REPO / 'engine' / 'dsv4_engine' / folder)}"
            bad += [f"{rel}: {r}" for r in reaches(p.read_text()) if f"{rel}:{r.split(' (')[0]}" not in ALLOWED]
    assert not bad, "use (or add) a public method:\n" + "\n".join(bad)
