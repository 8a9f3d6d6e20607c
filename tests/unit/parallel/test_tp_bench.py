"""`bench/tp_bench.py --quick` runs tp 1 and 2 on the tiny model and writes its JSON and PNG
(the full run is for a quiet machine: see docs/tensor-parallel.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench" / "tp_bench.py"


def test_quick_tp_bench_writes_its_report(tmp_path):
    out = tmp_path / "tp.json"
    r = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(x["preset"], x["tp"]) for x in rows] == [("tiny", 1), ("tiny", 2)]
    one, two = rows
    assert len(two["rank_weight_bytes"]) == 2 and max(two["rank_weight_bytes"]) < one["rank_weight_bytes"][0]
    assert one["first_tokens"] == two["first_tokens"] and all(x["best_tok_s"] > 0 for x in rows)
    assert out.with_suffix(".png").stat().st_size > 0
