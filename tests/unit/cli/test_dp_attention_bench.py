"""`dsv4 bench dp_attention`: the capacity it reads from the engine's /v1/loads (pure), and
(slow) its quick run writes the JSON and PNG its README row and docs quote."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.suites.dp_attention_bench import capacity


def test_capacity_counts_whole_requests_on_each_rank_pool():
    # 96-token requests on 16-token pages: 6 pages each, never split over two ranks' pools
    tp = {"kv_pages_total": 40, "kv_sizing": {"num_pages": 40}}
    dp = {"kv_pages_total": 40, "dp_size": 2, "dp_ranks": [{"kv_pages_total": 20}, {"kv_pages_total": 20}]}
    assert capacity(tp, 96) == {
        "kv_pages_per_rank": [40],
        "kv_tokens": 640,
        "requests_held": 6,
        "kv_sizing": {"num_pages": 40},
    }
    got = capacity(dp, 96)
    assert got["kv_tokens"] == 640 and got["requests_held"] == 6 and got["kv_pages_per_rank"] == [20, 20]
    assert capacity(dp, 97)["requests_held"] == 4  # 7 pages a request: 2 a rank, not 40 // 7 = 5


@pytest.mark.slow  # two engines of two ranks each: ~40 s on 2 cores
def test_quick_run_writes_both_layouts_and_their_ratios(tmp_path):
    out = tmp_path / "dp_attention.json"
    r = subprocess.run(
        [sys.executable, "-m", "dsv4_cli", "bench", "dp_attention", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    tp, dp = doc["rows"]
    assert (tp["layout"], dp["layout"]) == ("tp", "dp") and tp["rank_memory_mib"] == dp["rank_memory_mib"]
    assert len(dp["kv_pages_per_rank"]) == 2 and dp["kv_tokens"] > tp["kv_tokens"]
    assert set(doc["dp_over_tp"]["tiny"]) == {"kv_tokens", "requests_held", "best_tok_s", "best_tok_s_at_tp_batch"}
    assert out.with_suffix(".png").stat().st_size > 0
