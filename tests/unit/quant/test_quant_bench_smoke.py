"""bench/quant_bench.py runs end to end on CPU (--cpu --quick) and writes its JSON and PNG."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench" / "quant_bench.py"


def test_cpu_quick_bench_writes_json_and_png(tmp_path):
    out = tmp_path / "quant.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--cpu", "--quick", "--out", str(out)],
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
