"""The shell scripts users and CI run: scripts/get-tools.sh and tests/e2e/kind*.sh pass ShellCheck,
and get-tools.sh is idempotent (a second run finds every tool in place and fetches nothing)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: chart_testutil

from chart_testutil import GET_TOOLS, REPO, TOOLS_BIN, require_tool  # noqa: E402

SCRIPTS = [GET_TOOLS, REPO / "tests" / "e2e" / "kind.sh", REPO / "tests" / "e2e" / "kind-multinode.sh"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck_finds_nothing(script: Path) -> None:
    shellcheck = require_tool("shellcheck")
    proc = subprocess.run([shellcheck, "--norc", str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_shellcheck_catches_a_bad_script(tmp_path: Path) -> None:
    shellcheck = require_tool("shellcheck")
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/usr/bin/env bash\nrm -rf $DIR/*\n")
    proc = subprocess.run([shellcheck, "--norc", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "SC2086" in proc.stdout


def test_get_tools_is_idempotent_and_fast() -> None:
    for tool in ("helm", "kubectl", "hadolint", "shellcheck"):
        require_tool(tool)  # the first run (possibly a download) happens here, if needed
    before = {p.name: p.stat().st_mtime_ns for p in TOOLS_BIN.iterdir()}
    started = time.monotonic()
    proc = subprocess.run(["bash", str(GET_TOOLS)], cwd=REPO, capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr
    assert "helm v4." in proc.stdout and "hadolint" in proc.stdout
    assert {p.name: p.stat().st_mtime_ns for p in TOOLS_BIN.iterdir()} == before  # nothing rewritten
    assert elapsed < 5, f"a run with every tool present took {elapsed:.1f}s"
