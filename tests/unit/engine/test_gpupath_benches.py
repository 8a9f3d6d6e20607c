"""The attention-forms benchmark and the engine GPU smoke run end to end on CPU (--quick) and
write their JSON; the forms they compare agree."""

from __future__ import annotations

import json
import os
import subprocess

from bench import module_argv, module_env

ENV = module_env({**os.environ, "OMP_NUM_THREADS": "1"})  # 2 shared cores: spinning OpenMP threads only add noise


def test_attention_forms_quick(tmp_path):
    out = tmp_path / "forms.json"
    proc = subprocess.run(
        module_argv("bench.experiments.attention_forms", "--quick", "--out", out),
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert result["decode"] and result["extend"]
    assert all(r["max_abs_diff"] < 1e-4 and r["paged_ms"] > 0 for r in result["decode"])
    assert all(r["max_abs_diff"] < 1e-4 for r in result["extend"])
    assert any(r["expanded"] for r in result["extend"]) and not all(r["expanded"] for r in result["extend"])


def test_engine_smoke_quick_on_cpu(tmp_path, tiny_model):
    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        [
            *module_argv("bench.suites.engine_gpu_smoke"),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--backend",
            "torch",
            "--quick",
            "--model",
            str(tiny_model),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = json.loads(out.read_text())["runs"][0]
    assert run["seeded_equal"] and not run["sampling_errors"]
    assert set(run["itl_ms"]) == {"1", "2"}
