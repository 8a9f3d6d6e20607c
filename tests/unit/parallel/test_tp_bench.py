"""`bench/suites/tp_bench.py --quick` runs tp 1 and 2 on the tiny model and writes its JSON and PNG
(the full run is for a quiet machine: see docs/tensor-parallel.md)."""

from __future__ import annotations

import json
import subprocess

from bench import module_argv, module_env


def test_quick_tp_bench_writes_its_report(tmp_path):
    out = tmp_path / "tp.json"
    r = subprocess.run(
        module_argv("bench.suites.tp_bench", "--quick", "--out", out),
        capture_output=True,
        text=True,
        timeout=600,
        env=module_env(),
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(x["preset"], x["tp"]) for x in rows] == [("tiny", 1), ("tiny", 2)]
    one, two = rows
    assert len(two["rank_weight_bytes"]) == 2 and max(two["rank_weight_bytes"]) < one["rank_weight_bytes"][0]
    assert one["first_tokens"] == two["first_tokens"] and all(x["best_tok_s"] > 0 for x in rows)
    assert out.with_suffix(".png").stat().st_size > 0
