"""bench/suites/channel_bench.py --quick runs and writes what docs/process-shape.md quotes."""

from __future__ import annotations

import json
import subprocess

from bench import module_argv, module_env


def test_channel_bench_quick(tmp_path):
    r = subprocess.run(
        module_argv("bench.suites.channel_bench", "--quick", "--iters", "50", "--out", tmp_path),
        env=module_env(),
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
