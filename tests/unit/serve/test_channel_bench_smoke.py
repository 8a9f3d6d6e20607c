"""bench/channel_bench.py --quick runs and writes what docs/process-shape.md quotes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench"


def test_channel_bench_quick(tmp_path):
    r = subprocess.run(
        [sys.executable, str(BENCH / "channel_bench.py"), "--quick", "--iters", "50", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / "channel.json").read_text())
    trips = report["round_trip"]
    assert trips["step_32_rows"]["bytes"] > trips["step_1_rows"]["bytes"] > 0
    assert all(v["p50_us"] > 0 for v in trips.values())
    assert set(report["encoding_step_32_rows"]) == {"marshal", "pickle", "json"}
