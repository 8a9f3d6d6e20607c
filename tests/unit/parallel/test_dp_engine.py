"""`--tp-size 2 --dp-size 2` (rank 0 here, rank 1 a real child process, gloo on 127.0.0.1):
each rank attends over its own requests with its own page pool, the MoE runs over both ranks'
tokens. Greedy tokens equal `--tp-size 1` in fp32 with staggered arrivals (the first steps have
one request: one rank prefills while the other idles), chunked prefill, preemption on each rank
and an abort; each rank holds about half the pages a mirrored (TP) pool holds. Every run is
bounded by a deadline: a rank that skipped a collective would hang, and fails the test instead."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence

NEW_TOKENS = 8
DEADLINE_S = 120.0


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def prompts(vocab: int, lens: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]


def drive(engine: Engine, arrivals: dict, aborts: dict | None = None, watch=None) -> dict:
    """Step the engine by hand: requests join (and are aborted) at the steps given; `watch(step)`
    runs after every step. Returns each request's tokens and finish reason, and the preemptions."""
    outs: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    seqs: list[Sequence] = []
    total = sum(len(v) for v in arrivals.values())
    step = 0
    while len(reasons) < total:
        for rid, prompt in arrivals.get(step, []):

            def sink(out, rid=rid):
                outs.setdefault(rid, []).extend(out.token_ids)
                if out.finished:
                    reasons[rid] = out.finish_reason

            params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
            seqs.append(Sequence(rid, prompt, params, sink=sink))
            engine.submit(seqs[-1])
        for rid in (aborts or {}).get(step, []):
            engine.abort(rid)
        engine.step()
        if watch is not None:
            watch(step)
        step += 1
        assert step < 3000, "engine made no progress"
    assert engine.pool.allocator.num_free == engine.pool.allocator.total, "every page back after the run"
    return {"tokens": outs, "reasons": reasons, "preemptions": sum(q.num_preemptions for q in seqs)}


def staggered(engine: Engine, watch=None) -> dict:
    """Steps 0-2 have one request (one rank prefills, then decodes, while the other idles in
    every MoE layer); later ones join two at a time; one is aborted mid-decode."""
    v = engine.cfg.vocab_size
    ps = prompts(v, [5, 30, 17, 9, 20], seed=1)
    arrivals = {0: [("s0", ps[0])], 3: [("s1", ps[1]), ("s2", ps[2])], 7: [("s3", ps[3]), ("x", ps[4])]}
    return drive(engine, arrivals, aborts={10: ["x"]}, watch=watch)


def chunked(engine: Engine) -> dict:
    """16-token chunks; two requests of 36+ tokens (and 8 new) on a rank of 8 pages of 8: preemption."""
    ps = prompts(engine.cfg.vocab_size, [40, 36, 24, 30], seed=2)
    return drive(engine, {0: [("a", ps[0]), ("b", ps[1])], 2: [("c", ps[2]), ("d", ps[3])]})


def held_pages(e: Engine) -> list[int]:
    """Pages each rank's requests hold (one rank: the whole pool's, which TP ranks mirror)."""
    if e.args.dp_size > 1:
        return [r["kv_pages_held"] for r in e.loads()["dp_ranks"]]
    return [e.pool.allocator.total - e.pool.allocator.num_unused]


def engine(model_dir, tp: int, dp: int = 1, kv_pages: int = 10) -> Engine:
    return Engine(
        EngineArgs(
            model=str(model_dir),
            device="cpu",
            kernel_backend="cpu",
            kv_pages=kv_pages,
            page_size=8,
            max_num_batched_tokens=16,
            tp_size=tp,
            dp_size=dp,
            enable_prefix_cache=False,  # no cache (test_dp_cache_engine has one): the same pages held, step by step
        )
    )


def bounded(fn):
    """fn() in a thread, failed when it outlives DEADLINE_S (a deadlocked collective)."""
    box: dict = {}

    def run():
        try:
            box["out"] = fn()
        except BaseException as e:  # reported below
            box["err"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(DEADLINE_S)
    assert not t.is_alive(), f"the data-parallel engine did not finish within {DEADLINE_S:g} s (a hang)"
    if "err" in box:
        raise box["err"]
    return box["out"]


def test_dp2_greedy_tokens_equal_tp1_with_an_idle_rank_and_an_abort(make_model):
    model = make_model("tiny")
    ref_engine = engine(model, 1, kv_pages=20)
    ref_held: list[list[int]] = []
    ref = staggered(ref_engine, watch=lambda s: ref_held.append(held_pages(ref_engine)))
    e = engine(model, 2, 2)
    held: list[list[int]] = []
    try:
        loads = e.loads()
        assert loads["dp_size"] == 2 and [r["kv_pages_total"] for r in loads["dp_ranks"]] == [10, 10]
        assert loads["kv_pages_total"] == loads["kv_pages_free"] == 20  # the router's view: both pools
        running: list[list[int]] = []

        def watch(step):
            held.append(held_pages(e))
            running.append([r["running"] for r in e.loads()["dp_ranks"]])

        got = bounded(lambda: staggered(e, watch=watch))
    finally:
        e.tp.close()
    assert got["tokens"] == ref["tokens"] and got["reasons"] == ref["reasons"]
    assert got["reasons"]["x"] == "abort" and len(got["tokens"]) == 5
    # no page pressure: the same steps and the same pages, step by step, split over the ranks;
    # a rank's peak is well under a TP rank's (which mirrors every request's pages)
    assert [sum(h) for h in held] == [h[0] for h in ref_held], repr((held, ref_held))
    peak_dp, peak_tp = max(max(h) for h in held), max(h[0] for h in ref_held)
    assert peak_dp <= 0.65 * peak_tp, (held, ref_held)
    assert running[0] in ([1, 0], [0, 1]) and max(map(min, running)) == 2, running  # /v1/loads, per rank
    assert held[0] in ([1, 0], [0, 1]), "the first request alone: one rank holds its pages, the other none"
    assert all(p.poll() == 0 for p in e.tp.procs), "the other rank stops cleanly when told"
    print(f"peak pages held by one rank: dp 2 {peak_dp}, tp (mirrored) {peak_tp}; per step {held}")


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "mla512"])
def test_dp2_chunked_prefill_with_preemption_on_each_rank_equals_tp1(make_model, preset):
    model = make_model(preset)
    ref = chunked(engine(model, 1, kv_pages=20))
    e = engine(model, 2, 2, kv_pages=8)
    try:
        got = bounded(lambda: chunked(e))
    finally:
        e.tp.close()
    assert got["preemptions"] > 0, "8 pages a rank should have forced a preemption"
    assert got["tokens"] == ref["tokens"] and got["reasons"] == ref["reasons"]


@pytest.mark.slow
def test_dp4_with_three_idle_ranks_at_first_equals_tp1(make_model):
    model = make_model("tiny")
    ref = staggered(engine(model, 1, kv_pages=20))
    e = engine(model, 4, 4)
    try:
        got = bounded(lambda: staggered(e))
    finally:
        e.tp.close()
    assert got["tokens"] == ref["tokens"] and got["reasons"] == ref["reasons"]
