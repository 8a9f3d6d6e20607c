"""`dsv4 bench prefix --quick` starts real engines (cache on and off) on the tiny model, runs
every workload and writes the JSON (with the engine's own hit counters) and the PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def test_prefix_bench_quick_writes_its_report(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "dsv4_cli", "bench", "prefix", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "prefix.json").read_text())
    assert (tmp_path / "prefix.png").stat().st_size > 0
    on, off = report["sides"]["ours+cache"], report["sides"]["ours-nocache"]
    for side in (on, off):
        assert side["conversation"]["errors"] == 0 and side["concurrent"]["errors"] == 0
        assert all(x is not None for x in side["conversation"]["ttft_p50_ms_per_round"])
        assert side["warm_vs_cold"]["warm_ttft_ms"] is not None
    # The cache served the warm prefix and the later rounds; without it nothing is looked up.
    assert on["engine_prefix_cache"]["hit_tokens"] >= 160 and off["engine_prefix_cache"]["query_tokens"] == 0
    assert "skipped" in report["sides"]["vllm+cache"]
    assert report["targets"][0]["name"].startswith("warm TTFT / cold TTFT")
    assert all(len(side["load_average_start"]) == 3 for side in (on, off))


def test_sides_rerun_keeps_the_others_only_from_a_report_with_the_same_settings(tmp_path, monkeypatch):
    """--sides: the sides not rerun come from OUT/prefix.json, each marked with the run it came
    from; a report measured with other settings is not merged."""
    from bench.suites import prefix_bench

    a = prefix_bench.parse_args(["--quick", "--out", str(tmp_path), "--sides", "ours-nocache"])
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    (tmp_path / "prefix.json").write_text(
        json.dumps(
            {
                "started": "then",
                "settings": {**settings, "sides": None},
                "sides": {"ours+cache": {"load_average_start": [1, 2, 3]}, "ours-nocache": {"old": True}},
            }
        )
    )
    kept = prefix_bench.previous_sides(a)
    assert kept["ours+cache"] == {"load_average_start": [1, 2, 3], "measured_in": "then"}
    b = prefix_bench.parse_args(["--quick", "--out", str(tmp_path), "--sides", "ours-nocache", "--prompt-len", "64"])
    with pytest.raises(SystemExit, match="prompt_len"):
        prefix_bench.previous_sides(b)
