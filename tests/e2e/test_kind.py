"""The kind end-to-end (tests/e2e/kind.sh) from pytest: `python -m pytest -m e2e tests/e2e`.

It builds both images and runs a real cluster, so it is marked `e2e` and `slow` (out of the
default run) and skips, saying why, where no Docker daemon answers or kind is missing.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KIND_SH = REPO / "tests" / "e2e" / "kind.sh"


def docker_daemon_problem() -> str:
    """Why Docker cannot run containers here ("" when a daemon answers)."""
    docker = shutil.which("docker")
    if docker is None:
        return "no docker CLI on PATH"
    try:
        proc = subprocess.run(
            [docker, "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        return "docker info did not answer within 30 s"
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return "no Docker daemon answers (docker info: " + (lines[-1] if lines else f"exit {proc.returncode}") + ")"
    return ""


def test_kind_script_parses() -> None:
    proc = subprocess.run(["bash", "-n", str(KIND_SH)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.e2e
@pytest.mark.slow
def test_kind_end_to_end() -> None:
    problem = docker_daemon_problem()
    if problem:
        pytest.skip(f"kind end-to-end needs Docker: {problem}")
    if shutil.which("kind") is None:
        pytest.skip("kind end-to-end needs kind on PATH (https://kind.sigs.k8s.io/docs/user/quick-start/)")
    proc = subprocess.run(["bash", str(KIND_SH)], cwd=REPO, capture_output=True, text=True, timeout=3600)
    if proc.returncode == 2:  # a prerequisite kind.sh checks itself (helm/kubectl could not be fetched)
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert "PASS: evidence captured, wedged pod restarted, traffic recovered" in proc.stdout
