"""DeepSeek-V4 under `--tp-size 2 --dp-size 2` with MTP and the prefix cache per rank together
(rank 1 a real child process, gloo on 127.0.0.1): drafts stop at the cache's snapshot boundaries
and each rank keeps its own requests' snapshots. Conversations over one shared system prompt, two
rounds each: greedy tokens equal `--tp-size 1` without speculation, the second rounds resume
from cached prefixes on both ranks, and every page comes back. Bounded by a deadline."""

from __future__ import annotations

import pytest
from test_dp_cache_engine import PAGE, bounded, conversations, one_thread  # noqa: F401  (fixture)
from test_dp_v4_cache_engine import make_engine as cache_engine
from test_tp_spec_decode import mtp_models  # noqa: F401  (fixture)

from dsv4_engine.engine import Engine

pytestmark = pytest.mark.slow


def make_engine(model_dir, tp: int, spec: bool) -> Engine:
    kw = dict(speculative_algorithm="mtp", speculative_num_steps=3) if spec else {}
    return cache_engine(model_dir, tp, tp, **kw)


def test_v4_dp2_with_mtp_and_a_prefix_cache_per_rank_equals_tp1(mtp_models):
    model = mtp_models("v4-tiny")
    ref1, ref2 = conversations(make_engine(model, 1, False))
    e = make_engine(model, 2, True)
    try:
        assert e.prefix_cache_off is None and e.prefix_cache.snapshots is not None
        got1, got2 = bounded(lambda: conversations(e))
        loads = e.loads()
        e.prefix_cache.check()
        t = e.metrics.totals
        assert e.tp.failed is None
    finally:
        e.tp.close()
    assert got1["tokens"] == ref1["tokens"] and got2["tokens"] == ref2["tokens"]
    assert t["spec_decode_num_draft_tokens"] > 0
    assert set(got1["rank"].values()) == {0, 1}, got1["rank"]
    ranks = loads["prefix_cache"]["ranks"]
    assert all(r["hit_tokens"] > 0 and r["snapshots_restored"] > 0 for r in ranks), ranks
