"""The package architecture, checked from the source: which dsv4 package may import which, and
no import circles between modules (lazy, function-level imports count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
# The source folders, each holding import packages; FOLDER_BELOW draws them as a partial order.
ROOTS = [REPO / f for f in ("wire", "kernels", "engine", "router", "operator", "cli")]

# Layers, bottom up. The engine core knows no HTTP server, router or operator; the operator knows
# only the wire contract; the CLI is the one place that knows everything.
ALLOWED = {
    "dsv4_wire": set(),
    "dsv4_kernels": {"dsv4_wire"},
    "dsv4_engine": {"dsv4_wire", "dsv4_kernels"},
    "dsv4_serve": {"dsv4_wire", "dsv4_engine"},
    "dsv4_router": {"dsv4_wire"},
    "dsv4_operator": {"dsv4_wire"},
    "dsv4_cli": {"dsv4_wire", "dsv4_kernels", "dsv4_engine", "dsv4_serve", "dsv4_router", "dsv4_operator"},
}


def modules() -> dict[str, Path]:
    out = {}
    for root in ROOTS:
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if parts and parts[0].startswith("dsv4_"):
                out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            if t.split(".")[0].startswith("dsv4_"):
                # the deepest known module this import names
                parts = t.split(".")
                while parts and ".".join(parts) not in known:
                    parts.pop()
                if parts:
                    found.add(".".join(parts))
    found.discard(name)
    return found


GRAPH = {name: imports_of(name, path, modules()) for name, path in modules().items()}


def test_every_package_is_placed_in_a_layer() -> None:
    assert {m.split(".")[0] for m in GRAPH} <= set(ALLOWED)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_lower_layers(package: str) -> None:
    bad = sorted(
        f"{m} -> {t}"
        for m, ts in GRAPH.items()
        if m.split(".")[0] == package
        for t in ts
        if t.split(".")[0] not in ALLOWED[package] | {package}
    )
    assert not bad, "imports across layers:\n" + "\n".join(bad)


def test_engine_and_operator_are_independent() -> None:
    for a, b in (("dsv4_engine", "dsv4_operator"), ("dsv4_operator", "dsv4_engine")):
        bad = [f"{m} -> {t}" for m, ts in GRAPH.items() if m.startswith(a) for t in ts if t.startswith(b)]
        assert not bad, bad


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles() -> None:
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_one() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# Folders as a partial order: the folders each one is drawn directly above. A module imports only
# modules of its own folder or of a folder below it (transitively): the contracts (wire/) and the
# kernels are the floor; the engine, the router and the operator stand side by side, none of them
# importing another; the CLI is the roof.
FOLDER_BELOW = {
    "wire": set(),
    "kernels": {"wire"},
    "engine": {"wire", "kernels"},
    "router": {"wire"},
    "operator": {"wire"},
    "cli": {"wire", "kernels", "engine", "router", "operator"},
}


def folders_below(folder: str) -> set[str]:
    out: set[str] = set()
    todo = list(FOLDER_BELOW[folder])
    while todo:
        f = todo.pop()
        if f not in out:
            out.add(f)
            todo += FOLDER_BELOW[f]
    return out


def folder_of(module: str) -> str:
    top = module.split(".")[0]
    return next(root.name for root in ROOTS if (root / top).is_dir())


def test_every_folder_is_placed_in_the_order() -> None:
    assert {root.name for root in ROOTS} == set(FOLDER_BELOW)
    assert {folder_of(m) for m in GRAPH} == set(FOLDER_BELOW)


def test_each_package_sits_in_a_folder_above_the_packages_it_may_import() -> None:
    """The package layers and the folders agree: a package's allowed imports live in its own
    folder or below it, so the folders draw the layers."""
    folder = {p: folder_of(p) for p in ALLOWED}
    bad = [
        f"{p} ({folder[p]}/) may import {q} ({folder[q]}/)"
        for p, qs in ALLOWED.items()
        for q in qs
        if folder[q] != folder[p] and folder[q] not in folders_below(folder[p])
    ]
    assert not bad, bad


def test_no_module_imports_one_of_a_folder_not_below_it() -> None:
    bad = sorted(
        f"{m} ({folder_of(m)}/) -> {t} ({folder_of(t)}/)"
        for m, ts in GRAPH.items()
        for t in ts
        if folder_of(t) != folder_of(m) and folder_of(t) not in folders_below(folder_of(m))
    )
    assert not bad, "imports of a folder not drawn below:\n" + "\n".join(bad)


def test_the_folder_order_is_a_partial_order() -> None:
    """No folder is below itself (no circle), so the order is one."""
    assert all(f not in folders_below(f) for f in FOLDER_BELOW)


# The watchdog's decisions are pure: its package imports no network, Kubernetes or event-loop
# library, and nothing of the I/O package that carries its actions out (dsv4_operator.remediation).
IO_LIBRARIES = {"aiohttp", "httpx", "kopf", "kubernetes_asyncio", "asyncio", "socket", "subprocess", "urllib"}


def test_the_watchdog_package_does_no_io() -> None:
    root = REPO / "operator" / "dsv4_operator" / "watchdog"
    bad = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            bad += [
                f"{path.name}: {n}"
                for n in names
                if n.split(".")[0] in IO_LIBRARIES or n.startswith("dsv4_operator.remediation")
            ]
    assert not bad, bad


def test_the_kubernetes_operator_does_not_carry_dsv4_up() -> None:
    """`dsv4 up` (dsv4_operator.local) stands on the operator's watchdog, remediation and canary;
    nothing else of dsv4_operator imports it."""
    bad = [
        f"{m} -> {t}"
        for m, ts in GRAPH.items()
        if m.startswith("dsv4_operator.") and not m.startswith("dsv4_operator.local")
        for t in ts
        if t.startswith("dsv4_operator.local")
    ]
    assert not bad, bad
