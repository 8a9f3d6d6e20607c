"""`dsv4 bench agents --quick` runs 2 agents x 2 rounds (`tool_choice: "auto"`, the grammar on) on
the tiny model (cache on and off) and writes the JSON and the PNG; no round is malformed or lost."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_agents_bench_quick_writes_its_report(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "dsv4_cli", "bench", "agents", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "agents.json").read_text())
    assert (tmp_path / "agents.png").stat().st_size > 0
    sides = report["results"]["tiny"]
    assert set(sides) == {"mono+cache", "mono-nocache"}
    for side in sides.values():
        assert [r["requests"] for r in side["per_round"]] == [2, 2]
        assert side["quality"]["malformed_per_1000_rounds"] == side["quality"]["lost_per_1000_rounds"] == 0
        assert all(r["ttft_p50_ms"] > 0 for r in side["per_round"])
