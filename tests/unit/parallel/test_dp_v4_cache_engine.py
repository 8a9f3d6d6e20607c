"""DeepSeek-V4 (v4-tiny) under `--tp-size 2 --dp-size 2` with its prefix cache on (rank 0 here,
rank 1 a real child process, gloo on 127.0.0.1): a cached V4 prefix resumes only from a snapshot
of its slot row (window ring, compressor stages), and each rank keeps the snapshots of its own
requests (`parallel.dp_cache`). Conversations over one shared system prompt, two rounds each:
greedy tokens equal `--tp-size 1` with its cache on; each second round runs on the rank of its
first and resumes past its first round there (snapshots restored on rank 1 too); both ranks' hits
are counted on /v1/loads. Every run is bounded by a deadline."""

from __future__ import annotations

import pytest
from test_dp_cache_engine import PAGE, bounded, conversations, one_thread  # noqa: F401  (fixture)

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs

pytestmark = pytest.mark.slow


def make_engine(model_dir, tp: int, dp: int = 1, **kw) -> Engine:
    return Engine(
        EngineArgs(
            model=str(model_dir),
            device="cpu",
            kernel_backend="cpu",
            kv_pages=32,
            page_size=PAGE,
            max_num_seqs=8,
            max_num_batched_tokens=32,
            tp_size=tp,
            dp_size=dp,
            **kw,
        )
    )


def test_v4_dp2_with_snapshots_per_rank_equals_tp1_and_second_rounds_resume_on_their_rank(make_model):
    model = make_model("v4-tiny")
    ref_engine = make_engine(model, 1)
    ref1, ref2 = conversations(ref_engine)
    e = make_engine(model, 2, 2)
    try:
        assert e.prefix_cache_off is None and e.prefix_cache.snapshots is not None
        got1, got2 = bounded(lambda: conversations(e))
        loads = e.loads()
        e.prefix_cache.check()
    finally:
        e.tp.close()
    assert got1["tokens"] == ref1["tokens"] and got2["tokens"] == ref2["tokens"]
    assert got2["cached"] == ref2["cached"], "each second round resumes where one rank alone resumes"
    assert set(got1["rank"].values()) == {0, 1}, got1["rank"]
    for k, r in got1["rank"].items():
        assert got2["rank"][f"{k}.2"] == r, (got1["rank"], got2["rank"])
        assert got2["cached"][f"{k}.2"] > 2 * PAGE, "a second round resumes past the system prompt"
    ranks = loads["prefix_cache"]["ranks"]
    assert all(r["hit_tokens"] > 0 and r["snapshots_cached"] > 0 and r["snapshots_restored"] > 0 for r in ranks), ranks
    print(f"ranks {got1['rank']} -> {got2['rank']}; per-rank hits {[r['hit_tokens'] for r in ranks]}")
