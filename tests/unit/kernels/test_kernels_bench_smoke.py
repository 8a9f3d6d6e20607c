"""bench/suites/kernels_bench.py runs end to end on CPU (--cpu --quick) and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from bench import module_argv, module_env


def test_cpu_quick_bench_writes_decode_and_moe_results(tmp_path):
    out = tmp_path / "kernels.json"
    env = module_env({**os.environ, "OMP_NUM_THREADS": "1"})  # 2 shared cores: spinning OpenMP threads only add noise
    proc = subprocess.run(
        [*module_argv("bench.suites.kernels_bench"), "--cpu", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["meta"]["device"].startswith("cpu")
    decode = result["mla_decode"]
    assert {(r["batch"], r["context"]) for r in decode} == {(1, 256), (1, 1024), (8, 256), (8, 1024)}
    for row in decode:
        assert row["torch_us"] > 0 and row["torch_gbps"] >= 0
        assert row["bytes"] == row["batch"] * row["context"] * 576 * 2 + row["batch"] * 16 * (576 + 512) * 2
    assert [r["tokens"] for r in result["moe_experts"]] == [1, 64]
    assert all(r["torch_tflops"] > 0 for r in result["moe_experts"])


def test_bench_without_cuda_or_cpu_flag_says_what_to_do(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the GPU benchmark would run")
    proc = subprocess.run(
        [*module_argv("bench.suites.kernels_bench"), "--out", str(tmp_path / "x.json")],
        capture_output=True,
        text=True,
        timeout=60,
        env=module_env(),
    )
    assert proc.returncode != 0 and "--cpu" in proc.stderr
