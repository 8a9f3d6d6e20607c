"""Shared fixtures: checkpoints made once per session, and real engine processes on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


def _model(models_dir: Path, preset: str, seed: int = 0) -> Path:
    from dsv4_engine.checkpoint import init_checkpoint

    out = models_dir / f"{preset}-{seed}"
    if not (out / "config.json").exists():
        init_checkpoint(out, preset=preset, seed=seed)
    return out


@pytest.fixture(scope="session")
def make_model(models_dir):
    """make_model(preset, seed=0) -> checkpoint folder, written once per session."""
    return lambda preset, seed=0: _model(models_dir, preset, seed)


@pytest.fixture(scope="session")
def tiny_model(models_dir) -> Path:
    return _model(models_dir, "tiny")


@pytest.fixture(scope="session")
def mla512_model(models_dir) -> Path:
    return _model(models_dir, "mla512")


class Proc:
    """A dsv4 command running as a real process, with its log kept for failing tests."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None):
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "dsv4_engine.cli", *args], stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True,
        )

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self, url: str, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.args} exited with {self.popen.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{url}/ready", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{url} not ready after {timeout}s:\n{self.log()}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self._log.close()


@pytest.fixture
def spawn(tmp_path):
    """spawn([...dsv4 args]) -> Proc; every process is stopped at teardown."""
    procs: list[Proc] = []

    def _spawn(args: list[str], env: dict | None = None) -> Proc:
        p = Proc([str(a) for a in args], tmp_path / f"proc{len(procs)}.log", env)
        procs.append(p)
        return p

    yield _spawn
    for p in procs:
        p.stop()
