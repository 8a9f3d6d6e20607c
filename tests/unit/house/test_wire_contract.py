"""The wire contract is spelled once: labels, annotations and admin/PD paths appear as string
literals only in dsv4_wire; every other module imports them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dsv4_wire import k8s
from dsv4_wire.paths import Paths

REPO = Path(__file__).resolve().parents[3]
SOURCES = [
    p
    for root in ("cli", "engine", "kernels", "operator", "router", "wire")
    for p in (REPO / root).rglob("*.py")
    if "dsv4_wire" not in p.parts
]

ONCE = {
    **{
        name: getattr(k8s, name)
        for name in dir(k8s)
        if name.startswith(("LABEL_", "ANNOTATION_")) and "serving.dsv4.dev" in getattr(k8s, name)
    },
    **{
        name: getattr(Paths, name)
        for name in dir(Paths)
        if name.startswith(("ADMIN_", "DEBUG_", "PD_", "BOOTSTRAP_")) or name in ("LOADS", "READY", "SERVER_INFO")
    },
}


def string_literals(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            out.append(node.value)
    return out


LITERALS = {p: string_literals(p) for p in SOURCES}


@pytest.mark.parametrize("name", sorted(ONCE))
def test_spelled_only_in_the_wire_package(name: str) -> None:
    value = ONCE[name]
    hits = [str(p.relative_to(REPO)) for p, lits in LITERALS.items() if any(lit == value for lit in lits)]
    assert not hits, f"{value!r} ({name}) is spelled again in {hits}; import dsv4_wire instead"


def test_the_check_sees_a_literal() -> None:
    src = REPO / "wire" / "dsv4_wire" / "k8s.py"
    assert k8s.LABEL_DRAINING in string_literals(src)


def test_router_only_fields_are_fields_of_the_engine_protocol() -> None:
    """The router writes these names, the engine's request models read them: one spelling."""
    from dsv4_serve.protocol import ChatCompletionRequest, CompletionRequest
    from dsv4_wire.request_fields import ROUTER_ONLY_FIELDS

    for model in (CompletionRequest, ChatCompletionRequest):
        assert set(ROUTER_ONLY_FIELDS) <= set(model.model_fields), model.__name__
