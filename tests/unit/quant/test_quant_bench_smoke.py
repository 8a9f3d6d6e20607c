"""bench/suites/quant_bench.py runs end to end on CPU (--cpu --quick) and writes its JSON and PNG."""

from __future__ import annotations

import json
import os
import subprocess

from bench import module_argv, module_env


def test_cpu_quick_bench_writes_json_and_png(tmp_path):
    out = tmp_path / "quant.json"
    env = module_env({**os.environ, "OMP_NUM_THREADS": "1"})
    proc = subprocess.run(
        [*module_argv("bench.suites.quant_bench"), "--cpu", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["meta"]["device"] == "cpu" and result["meta"]["timing"] == "best of N"
    rows = result["linear"]
    assert [(r["weight"], r["tokens"]) for r in rows] == [("q_b", 1), ("q_b", 64)]
    for r in rows:
        assert r["bf16_us"] > 0 and r["fp8_us"] > 0
        assert r["fp8_bytes"] < 0.6 * r["bf16_bytes"]
    assert out.with_suffix(".png").stat().st_size > 1000
