"""Every `DSV4_*` environment switch is declared once (dsv4_wire.switches) and read through it;
the models reach the kernels only through the kernel API (dsv4_kernels.api.get_ops)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from dsv4_wire import switches

REPO = Path(__file__).resolve().parents[3]
SOURCES = [REPO / f for f in ("wire", "kernels", "engine", "router", "operator", "cli", "bench", "scripts")]
TABLE = REPO / "wire" / "dsv4_wire" / "switches.py"
NAME = re.compile(r"\bDSV4_[A-Z0-9_]*[A-Z0-9]\b")
# a read by a literal name: os.environ.get("DSV4_..."), os.environ["DSV4_..."], os.getenv("DSV4_...")
# (setting or deleting one, as a bench does for a child, is no read)
LITERAL_READ = re.compile(r"""(environ\.get\(|(?<!del os\.)environ\[|getenv\()\s*["']DSV4_\w+["']\)?(?!\]?\s*=[^=])""")


def _sources() -> list[Path]:
    return [p for root in SOURCES for p in root.rglob("*.py") if p != TABLE]


def test_every_switch_named_in_the_source_is_declared() -> None:
    undeclared = sorted(
        f"{p.relative_to(REPO)}: {n}"
        for p in _sources()
        for n in set(NAME.findall(p.read_text()))
        if n not in switches.SWITCHES
    )
    assert not undeclared, "declare these in dsv4_wire.switches.SWITCHES:\n" + "\n".join(undeclared)


def test_no_switch_is_read_by_its_literal_name() -> None:
    reads = sorted(
        f"{p.relative_to(REPO)}:{i}"
        for p in _sources()
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if LITERAL_READ.search(line)
    )
    assert not reads, "read these through dsv4_wire.switches.read / on:\n" + "\n".join(reads)


def test_a_switch_reads_as_its_declared_type() -> None:
    assert switches.read("DSV4_TP_TIMEOUT_S", {}) == 300.0
    assert switches.read("DSV4_TP_TIMEOUT_S", {"DSV4_TP_TIMEOUT_S": "7.5"}) == 7.5
    assert switches.on("DSV4_NO_NATIVE", {"DSV4_NO_NATIVE": "1"})
    assert not switches.on("DSV4_NO_NATIVE", {"DSV4_NO_NATIVE": "0"})
    assert not switches.on("DSV4_NO_NATIVE", {})
    with pytest.raises(KeyError, match="not declared"):
        switches.read("DSV4_NOT_A_SWITCH", {})


def test_the_models_import_no_kernel_module_but_the_kernel_api() -> None:
    bad = []
    for p in (REPO / "engine" / "dsv4_engine" / "models").rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dsv4_kernels"):
                if node.module != "dsv4_kernels.api" or any(a.name != "get_ops" for a in node.names):
                    bad.append(f"{p.name}: from {node.module} import {', '.join(a.name for a in node.names)}")
            elif isinstance(node, ast.Import) and any(a.name.startswith("dsv4_kernels") for a in node.names):
                bad.append(f"{p.name}: import {', '.join(a.name for a in node.names)}")
    assert not bad, "the models call the kernel backend (ops.*) only:\n" + "\n".join(bad)


def test_the_models_hold_no_native_flags_and_ask_no_backend_what_it_is() -> None:
    found = sorted(
        f"{p.name}:{i}"
        for p in (REPO / "engine" / "dsv4_engine" / "models").rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"\bself\.native_\w+|getattr\(\s*(self\.)?k?ops\b", line)
    )
    assert not found, "\n".join(found)
