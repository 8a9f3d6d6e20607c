"""A `DSV4_*` switch is read through the table (dsv4_wire.switches.read / on), also where the code
names it by a constant (`*_ENV = "DSV4_..."`): no `environ.get(X_ENV)` / `environ[X_ENV]`, so
every read gets the declared type and default. Writing one (an env dict for a child process, a
manifest) still uses the constant."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
ROOTS = [REPO / f for f in ("wire", "kernels", "engine", "router", "operator", "cli")]


def switch_constants(trees: list[ast.Module]) -> set[str]:
    """Names bound to a switch's name: `X_ENV = "DSV4_..."`, and aliases of those (`Y = X_ENV`)."""
    names: set[str] = set()
    aliases: list[tuple[str, str]] = []
    for tree in trees:
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                v, target = node.value, node.targets[0].id
                if isinstance(v, ast.Constant) and isinstance(v.value, str) and v.value.startswith("DSV4_"):
                    names.add(target)
                elif isinstance(v, ast.Name):
                    aliases.append((target, v.id))
    names |= {t for t, v in aliases if v in names}
    return names


def _constant(node: ast.AST, names: set[str]) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name in names


def _environ(node: ast.AST) -> bool:
    """os.environ, or a parameter named environ / env."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ"
    return isinstance(node, ast.Name) and node.id in ("environ", "env")


def reads_by_constant(tree: ast.Module, names: set[str]) -> list[int]:
    """Lines that read an environment mapping by one of the switch constants `names`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            if _environ(node.func.value) and node.args and _constant(node.args[0], names):
                out.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if _environ(node.value) and _constant(node.slice, names):
                out.append(node.lineno)
    return out


def test_no_switch_is_read_by_its_constant():
    texts = {path: path.read_text() for root in ROOTS for path in root.rglob("*.py")}
    # only modules that bind a switch's name or read an environment need parsing (the scan's cost)
    files = {p: ast.parse(t) for p, t in texts.items() if "environ" in t or "_ENV" in t}
    names = switch_constants(list(files.values()))
    assert {"SPEC_ENV", "OPERATOR_KEY_ENV", "SECRET_ENV"} <= names  # the scan finds the constants
    found = []
    for path, tree in files.items():
        found += [f"{path.relative_to(REPO)}:{n}" for n in reads_by_constant(tree, names)]
    assert not found, "read these through dsv4_wire.switches.read: " + ", ".join(found)


def test_the_scan_sees_a_read_and_not_a_write():
    src = (
        "SPEC_ENV = 'DSV4_TP_SPEC'\n"
        "a = os.environ.get(SPEC_ENV)\n"
        "b = environ[TIMEOUT_ENV]\n"
        "env = {**os.environ, SPEC_ENV: '1'}\n"
        "os.environ[SPEC_ENV] = 'x'\n"
    )
    names = switch_constants([ast.parse(src), ast.parse("TIMEOUT_ENV = 'DSV4_TP_TIMEOUT_S'\nPOD_IP_ENV = 'POD_IP'")])
    assert names == {"SPEC_ENV", "TIMEOUT_ENV"}
    assert reads_by_constant(ast.parse(src + "c = os.environ.get(POD_IP_ENV)\n"), names) == [2, 3]
