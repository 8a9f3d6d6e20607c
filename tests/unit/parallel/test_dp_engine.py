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
    runs after every step. Returns each request's tokens and finish reason."""
    outs: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    total = sum(len(v) for v in arrivals.values())
    step = 0
    while len(reasons) < total:
        for rid, prompt in arrivals.get(step, []):

            def sink(out, rid=rid):
                outs.setdefault(rid, []).extend(out.token_ids)
                if out.finished:
                    reasons[rid] = out.finish_reason

            engine.submit(
                Sequence(rid, prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True), sink=sink)
            )
        for rid in (aborts or {}).get(step, []):
            engine.abort(rid)
        engine.step()
        if watch is not None:
            watch(step)
        step += 1
        assert step < 3000, "engine made no progress"
    assert engine.pool.allocator.num_free == engine.pool.allocator.total, "every page back after the run"
    return {"tokens": outs, "reasons": reasons}


def scenarios(engine: Engine, watch=None) -> dict:
    v = engine.cfg.vocab_size
    ps = prompts(v, [5, 30, 17, 9], seed=1)
    # step 0..2: one request only (one rank prefills and decodes, the other idles in every MoE)
    staggered = drive(engine, {0: [("s0", ps[0])], 3: [("s1", ps[1]), ("s2", ps[2])], 7: [("s3", ps[3])]})
    ps = prompts(v, [40, 36, 24, 30], seed=2)
    # 16-token chunks; two requests of 40+8 tokens on a rank of 10 pages of 8: preemption
    chunked = drive(engine, {0: [("a", ps[0]), ("b", ps[1])], 2: [("c", ps[2]), ("d", ps[3])]}, watch=watch)
    ps = prompts(v, [12, 20, 7], seed=3)
    aborted = drive(engine, {0: [("k0", ps[0]), ("x", ps[1])], 1: [("k1", ps[2])]}, aborts={3: ["x"]})
    return {"staggered": staggered, "chunked": chunked, "aborted": aborted}


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


def test_dp2_greedy_tokens_equal_tp1_and_each_rank_holds_half_the_pages(make_model):
    model = make_model("tiny")
    # the reference's pool holds every request (as every rank of a TP engine mirrors it)
    ref_engine = engine(model, 1, kv_pages=20)
    ref_held: list[int] = []
    ref = scenarios(ref_engine, watch=lambda s: ref_held.append(ref_engine.pool.allocator.total - ref_engine.pool.allocator.num_unused))
    e = engine(model, 2, 2)
    held: list[list[int]] = []
    try:
        loads = e.loads()
        assert loads["dp_size"] == 2 and [r["kv_pages_total"] for r in loads["dp_ranks"]] == [10, 10]

        def watch(step):
            held.append([r["kv_pages_held"] for r in e.loads()["dp_ranks"]])

        got = bounded(lambda: scenarios(e, watch))
        preempted = e.metrics.totals.get("preemptions", None)
    finally:
        e.tp.close()
    for name in ("staggered", "chunked", "aborted"):
        assert got[name]["tokens"] == ref[name]["tokens"], name
        assert got[name]["reasons"] == ref[name]["reasons"], name
    assert got["aborted"]["reasons"]["x"] == "abort" and len(got["staggered"]["tokens"]) == 4
    # the same batch: a rank holds about half of what a mirrored pool holds
    peak = max(ref_held)
    assert max(max(h) for h in held) <= 10 < peak, (held, ref_held)
    assert all(p.poll() == 0 for p in e.tp.procs), "the other rank stops cleanly when told"
    print("pages per rank (dp 2):", max(held, key=sum), "mirrored (tp):", peak, "preemptions:", preempted)
