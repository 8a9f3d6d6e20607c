"""The multi-node kind end-to-end (tests/e2e/kind-multinode.sh) from pytest: a two-pod decode
engine under LeaderWorkerSet (installed from its release) or the operator's StatefulSet pair,
one pod deleted, the group made anew. Marked `e2e` and `slow`; skips, saying why, where no
Docker daemon answers or kind is missing (as on the machines this project is built on)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from test_kind import docker_daemon_problem

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "e2e" / "kind-multinode.sh"


def test_multinode_kind_script_parses() -> None:
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("form", ["lws", "pair"])
def test_kind_two_node_group(form: str) -> None:
    problem = docker_daemon_problem()
    if problem:
        pytest.skip(f"the multi-node kind end-to-end needs Docker: {problem}")
    if shutil.which("kind") is None:
        pytest.skip("the multi-node kind end-to-end needs kind on PATH (https://kind.sigs.k8s.io)")
    proc = subprocess.run(
        ["bash", str(SCRIPT)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=5400,
        env={**__import__("os").environ, "DSV4_E2E_FORM": form, "DSV4_E2E_CLUSTER": f"dsv4-e2e-{form}"},
    )
    if proc.returncode == 2:
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert f"PASS: a two-node group served, lost a pod, was made anew whole and served again ({form})" in proc.stdout
