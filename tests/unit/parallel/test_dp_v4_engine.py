"""DeepSeek-V4 (v4-tiny) under `--tp-size 2 --dp-size 2` (rank 0 here, rank 1 a real child
process, gloo on 127.0.0.1): each rank runs mHC, norms, attention, compressors and indexer over its
own requests against its own pages and slot rows; each MoE (hash-routed layers included, whose
experts come from the gathered rows' token ids) runs over both ranks' rows. Greedy tokens equal
`--tp-size 1` in fp32 with staggered arrivals (one rank prefills while the other idles), chunked
prefill past every window and compression boundary, preemption on each rank and an abort; each
rank holds about half the pages a mirrored (TP) pool holds. Every run is bounded by a deadline."""

from __future__ import annotations

import pytest
from test_dp_engine import bounded, drive, held_pages, one_thread, prompts  # noqa: F401  (fixture)

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs


def engine(model_dir, tp: int, dp: int = 1, kv_pages: int = 12) -> Engine:
    return Engine(
        EngineArgs(
            model=str(model_dir),
            device="cpu",
            kernel_backend="cpu",
            kv_pages=kv_pages,
            page_size=8,
            max_num_seqs=8,
            max_num_batched_tokens=16,
            tp_size=tp,
            dp_size=dp,
            enable_prefix_cache=False,  # as at --dp-size > 1: the same pages held, step by step
        )
    )


def staggered(e: Engine, watch=None) -> dict:
    """Steps 0-2 have one request (past v4-tiny's window of 8 and its CSA / HCA windows of 4 and
    8); later ones join two at a time; one is aborted mid-decode."""
    ps = prompts(e.cfg.vocab_size, [13, 30, 17, 9, 20], seed=1)
    arrivals = {0: [("s0", ps[0])], 3: [("s1", ps[1]), ("s2", ps[2])], 7: [("s3", ps[3]), ("x", ps[4])]}
    return drive(e, arrivals, aborts={10: ["x"]}, watch=watch)


def chunked(e: Engine) -> dict:
    """16-token chunks; two requests of 36+ tokens (and 8 new) on a rank of 8 pages of 8: preemption."""
    ps = prompts(e.cfg.vocab_size, [40, 36, 24, 30], seed=2)
    return drive(e, {0: [("a", ps[0]), ("b", ps[1])], 2: [("c", ps[2]), ("d", ps[3])]})


def test_v4_dp2_greedy_tokens_equal_tp1_with_an_idle_rank_and_an_abort(make_model):
    model = make_model("v4-tiny")
    ref_engine = engine(model, 1, kv_pages=24)
    ref_held: list[list[int]] = []
    ref = staggered(ref_engine, watch=lambda s: ref_held.append(held_pages(ref_engine)))
    e = engine(model, 2, 2)
    held: list[list[int]] = []
    try:
        loads = e.loads()
        assert loads["dp_size"] == 2 and [r["kv_pages_total"] for r in loads["dp_ranks"]] == [12, 12]
        running: list[list[int]] = []

        def watch(step):
            held.append(held_pages(e))
            running.append([r["running"] for r in e.loads()["dp_ranks"]])

        got = bounded(lambda: staggered(e, watch=watch))
    finally:
        e.tp.close()
    assert got["tokens"] == ref["tokens"] and got["reasons"] == ref["reasons"]
    assert got["reasons"]["x"] == "abort" and len(got["tokens"]) == 5
    # the same pages step by step, split over the ranks; a rank's peak well under TP's mirror
    assert [sum(h) for h in held] == [h[0] for h in ref_held], repr((held, ref_held))
    peak_dp, peak_tp = max(max(h) for h in held), max(h[0] for h in ref_held)
    assert peak_dp <= 0.65 * peak_tp, (held, ref_held)
    assert held[0] in ([2, 0], [0, 2]), "the first request alone: one rank holds its pages, the other none"
    assert max(map(min, running)) == 2, running  # later, two requests on each rank (/v1/loads)
    assert all(p.poll() == 0 for p in e.tp.procs), "the other rank stops cleanly when told"
    print(f"v4-tiny peak pages held by one rank: dp 2 {peak_dp}, tp (mirrored) {peak_tp}; per step {held}")


@pytest.mark.slow
def test_v4_dp2_chunked_prefill_with_preemption_on_each_rank_equals_tp1(make_model):
    model = make_model("v4-tiny")
    ref = chunked(engine(model, 1, kv_pages=24))
    e = engine(model, 2, 2, kv_pages=8)
    try:
        got = bounded(lambda: chunked(e))
    finally:
        e.tp.close()
    assert got["preemptions"] > 0, "8 pages a rank should have forced a preemption"
    assert got["tokens"] == ref["tokens"] and got["reasons"] == ref["reasons"]


@pytest.mark.slow
def test_v4_dp4_with_three_idle_ranks_at_first_equals_tp1(make_model):
    model = make_model("v4-tiny")
    ref = staggered(engine(model, 1, kv_pages=24))
    e = engine(model, 4, 4)
    try:
        got = bounded(lambda: staggered(e))
    finally:
        e.tp.close()
    assert got["tokens"] == ref["tokens"] and got["reasons"] == ref["reasons"]
