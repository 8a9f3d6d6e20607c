"""The engine with --kernel-backend triton (Triton kernels, under the interpreter on CPU)
matches the torch backend on the tiny model: a batch of two requests, prefill then decode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the probe forces the CPU interpreter; on CUDA the kernel tests run compiled"
)
def test_triton_backend_matches_torch_backend(tiny_model):
    probe = Path(__file__).with_name("probe.py")
    r = subprocess.run([sys.executable, str(probe), str(tiny_model)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["triton"]["tokens"] == out["torch"]["tokens"]
    for ours, ref in zip(out["triton"]["steps"], out["torch"]["steps"]):
        assert torch.allclose(torch.tensor(ours), torch.tensor(ref), atol=1e-4, rtol=1e-4)
