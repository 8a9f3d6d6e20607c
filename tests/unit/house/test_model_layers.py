"""The models are compositions of layers over one kernel API: a model or layer module imports no
kernel module but `dsv4_kernels.api` (every op goes through the backend object it returns), and a
layer imports no model (layers sit below the models). Imports inside functions count; imports
under `if TYPE_CHECKING:` (annotations only, never run) do not."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[3] / "engine" / "dsv4_engine"
MODELS = sorted((ENGINE / "models").glob("*.py"))
LAYERS = sorted((ENGINE / "layers").glob("*.py"))


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def runtime_imports(path: Path) -> set[str]:
    """Every module a file imports when it runs (absolute imports; the package uses no relative ones)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def kernel_modules(names: set[str]) -> set[str]:
    return {n for n in names if n.split(".")[0] == "dsv4_kernels" and not n.startswith("dsv4_kernels.api")}


def test_the_folders_hold_what_the_rules_check():
    assert len(MODELS) > 3 and len(LAYERS) > 3


@pytest.mark.parametrize("path", MODELS + LAYERS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_models_and_layers_import_only_the_kernel_api(path):
    assert not kernel_modules(runtime_imports(path)), (
        f"{path.name} imports a kernel module: use ops.* (dsv4_kernels.api)"
    )


@pytest.mark.parametrize("path", LAYERS, ids=lambda p: p.name)
def test_layers_import_no_model(path):
    models = {n for n in runtime_imports(path) if n.startswith("dsv4_engine.models")}
    assert not models, f"layers/{path.name} imports {sorted(models)}: layers sit below the models"


def test_the_checks_see_what_they_forbid(tmp_path):
    """The scanner finds a kernel import inside a function and skips a TYPE_CHECKING one."""
    f = tmp_path / "m.py"
    f.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from dsv4_engine.models.forward_batch import ForwardBatch\n"
        "def g():\n    from dsv4_kernels import cpu_moe\n"
        "from dsv4_kernels.api import get_ops\n"
    )
    names = runtime_imports(f)
    assert kernel_modules(names) == {"dsv4_kernels", "dsv4_kernels.cpu_moe"}
    assert not any(n.startswith("dsv4_engine.models") for n in names)


KERNELS = ENGINE.parents[1] / "kernels" / "dsv4_kernels"
REFERENCES = [KERNELS / n for n in ("reference.py", "reference_v4.py", "reference_quant.py", "grouped_moe.py")]


@pytest.mark.parametrize("path", REFERENCES, ids=lambda p: p.name)
def test_the_reference_is_pure_torch(path):
    """The torch reference (and the grouped experts it shares) imports no native (C) kernel: the
    CPU backend hands its native passes in; the oracle never runs them."""
    native = {n for n in runtime_imports(path) if n.startswith(("dsv4_kernels.cpu_", "dsv4_kernels.native"))}
    assert not native, f"{path.name} imports {sorted(native)}"
