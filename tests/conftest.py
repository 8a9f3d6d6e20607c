"""Shared fixtures: checkpoints made once per session, and real engine processes on 127.0.0.1."""

from __future__ import annotations

import os
from pathlib import Path

# Triton picks its CPU interpreter when triton.language is first imported, and modules collected
# before the kernel tests import it too (transformers does): choose it before anything is collected.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest

from bench.harness.commands import Proc, free_port, stop_all  # noqa: F401  (re-exported for tests)


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


@pytest.fixture
def spawn(tmp_path):
    """spawn([...dsv4 args]) -> Proc; every process is stopped at teardown."""
    procs: list[Proc] = []

    def _spawn(args: list[str], env: dict | None = None) -> Proc:
        p = Proc([str(a) for a in args], tmp_path / f"proc{len(procs)}.log", env)
        procs.append(p)
        return p

    yield _spawn
    stop_all(procs)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models on a shared 2-core machine: torch's second OpenMP thread only spins, and a
    v4-tiny forward took ~1 s instead of ~20 ms under load. Modules that step small engines ask
    for it with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
