"""The prefix cache on its own (allocator + tree) and inside a real engine (tiny preset):
reuse, reference counts, LRU eviction, and greedy outputs identical to an engine without it."""

from __future__ import annotations

import random

import pytest

from dsv4_engine.engine import Engine, prefix_cache_refusal
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.kv_cache import PageAllocator
from dsv4_engine.prefix_cache import PrefixCache
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence

PS = 4


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=4, temperature=0))


def compute(cache: PrefixCache, alloc: PageAllocator, s: Sequence, upto: int) -> None:
    """What the scheduler and engine do for a request that computes up to `upto` tokens."""
    need = -(-upto // PS) - len(s.pages)
    if need > 0:
        pages = alloc.allocate(need)
        assert pages is not None
        s.pages.extend(pages)
    s.num_computed = upto
    cache.insert(s)


def release(cache: PrefixCache, alloc: PageAllocator, s: Sequence) -> None:
    alloc.free(s.pages)
    s.pages = []
    s.num_computed = 0
    cache.forget(s)


# ---- the tree and the allocator ------------------------------------------------------------


def test_reuses_full_pages_of_the_longest_prefix_and_recomputes_the_last_token():
    alloc = PageAllocator(16)
    cache = PrefixCache(alloc, PS)
    a = seq("a", list(range(10)))  # pages [0..3] [4..7], 2 tokens in a partial page
    assert cache.attach(a) == 0
    compute(cache, alloc, a, 10)
    assert cache.num_cached == 2  # only full pages
    b = seq("b", list(range(8)) + [99, 98])
    assert cache.attach(b) == 8 and b.pages == a.pages[:2]
    assert all(alloc.refcount(p) == 2 for p in b.pages)
    # Exactly 8 tokens, all cached: the last one is recomputed, so only the first page is reused.
    c = seq("c", list(range(8)))
    assert cache.attach(c) == 4 and c.pages == a.pages[:1]
    # A different first page: nothing.
    d = seq("d", [7] + list(range(1, 10)))
    assert cache.attach(d) == 0 and d.pages == []
    cache.check()


def test_pages_stay_cached_when_unreferenced_and_count_as_free():
    alloc = PageAllocator(8)
    cache = PrefixCache(alloc, PS)
    a = seq("a", list(range(12)))
    cache.attach(a)
    compute(cache, alloc, a, 12)
    assert alloc.num_free == 5 and alloc.num_unused == 5
    release(cache, alloc, a)
    assert cache.num_cached == 3 and cache.num_idle == 3
    assert alloc.num_free == 8 and alloc.num_unused == 5  # idle cached pages are reclaimable
    b = seq("b", list(range(12)) + [1])
    assert cache.attach(b) == 12
    assert cache.num_idle == 0 and alloc.num_free == 5
    cache.check()


def test_eviction_takes_unreferenced_leaves_least_recently_used_first():
    alloc = PageAllocator(6)
    cache = PrefixCache(alloc, PS)
    old, new = seq("old", [1] * 8), seq("new", [2] * 8)
    for s in (old, new):
        cache.attach(s)
        compute(cache, alloc, s, 8)
        release(cache, alloc, s)
    held = seq("held", [3] * 4 + [0])
    cache.attach(held)
    compute(cache, alloc, held, 5)  # one cached page it references, one private partial page
    assert alloc.num_unused == 0 and alloc.num_free == 4
    assert alloc.allocate(2) is not None  # evicts the oldest chain, leaf first then its root page
    assert cache.attach(seq("x", [1] * 8 + [0])) == 0
    y = seq("y", [2] * 8 + [0])
    assert cache.attach(y) == 8  # the newer chain survived
    cache.check()
    # Only idle pages can be taken: y's and held's cached pages are referenced, never evicted.
    assert alloc.num_free == 0 and alloc.allocate(1) is None
    assert all(alloc.refcount(p) == 1 for p in held.pages + y.pages)


def test_nothing_is_evicted_when_an_allocation_cannot_be_met():
    alloc = PageAllocator(4)
    cache = PrefixCache(alloc, PS)
    a = seq("a", list(range(8)))
    cache.attach(a)
    compute(cache, alloc, a, 8)
    release(cache, alloc, a)
    assert alloc.allocate(5) is None
    assert cache.num_cached == 2


def test_a_request_swaps_its_copy_of_a_page_someone_else_cached_first():
    alloc = PageAllocator(16)
    cache = PrefixCache(alloc, PS)
    a, b = seq("a", list(range(12))), seq("b", list(range(12)))
    cache.attach(a)
    cache.attach(b)  # both miss: they compute the same prefix at once
    compute(cache, alloc, a, 8)
    compute(cache, alloc, b, 8)
    assert b.pages == a.pages and b.num_cached_pages == 2  # b's copies went back, it holds a's
    assert cache.num_cached == 2 and alloc.num_unused == 16 - 2
    release(cache, alloc, b)
    assert alloc.num_unused == 16 - 2 and cache.num_idle == 0  # a still holds them
    release(cache, alloc, a)
    cache.check()
    assert alloc.num_free == 16


def test_reference_underflow_is_loud():
    alloc = PageAllocator(4)
    cache = PrefixCache(alloc, PS)
    a = seq("a", list(range(8)))
    cache.attach(a)
    compute(cache, alloc, a, 8)
    pages = list(a.pages)
    release(cache, alloc, a)
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.free(pages[:1])  # cached and idle: nobody holds it
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.free([3])  # never handed out
    with pytest.raises(RuntimeError, match="neither held nor cached"):
        alloc.share([3])


def test_which_engines_build_a_cache(tiny_model, make_model):
    from dsv4_engine.models.state import StateSpec

    paged = StateSpec("kv", 2, (8,))
    window = StateSpec("window", 2, (8,), kind="slot", slots=4)
    assert prefix_cache_refusal([paged], "mono") is None
    assert prefix_cache_refusal([paged], "prefill") is None
    assert "decode" in prefix_cache_refusal([paged], "decode")
    assert "disable-prefix-cache" in prefix_cache_refusal([paged], "mono", enabled=False)
    # slot states: reused through snapshots (tests/unit/engine/test_v4_prefix_cache.py; over
    # several ranks tests/unit/parallel/test_tp_engine.py), except with no snapshots
    assert prefix_cache_refusal([paged, window], "mono") is None
    assert "snapshots 0" in prefix_cache_refusal([paged, window], "mono", snapshots=0)
    v4 = Engine(
        EngineArgs(
            model=str(make_model("v4-tiny")),
            device="cpu",
            kernel_backend="cpu",
            kv_pages=16,
            max_num_seqs=2,
            prefix_cache_snapshots=0,
        )
    )
    assert v4.prefix_cache is None and v4.scheduler.cache is None
    assert v4.loads()["prefix_cache"]["enabled"] is False
    assert engine_for(tiny_model, True).loads()["prefix_cache"]["enabled"] is True


# ---- a real engine -------------------------------------------------------------------------


def drive(engine: Engine, arrivals: dict[int, list[tuple[str, list[int], int]]], aborts: dict[int, list[str]]):
    """Step an engine by hand (deterministic); returns {rid: (tokens, finish_reason)}."""
    outs: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    seqs: list[Sequence] = []

    def sink_for(rid):
        def sink(out):
            outs.setdefault(rid, []).extend(out.token_ids)
            if out.finished:
                reasons[rid] = out.finish_reason

        return sink

    total = sum(len(v) for v in arrivals.values())
    step = 0
    while len(reasons) < total:
        for rid, prompt, n in arrivals.get(step, []):
            seqs.append(
                Sequence(rid, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), sink=sink_for(rid))
            )
            engine.submit(seqs[-1])
        for rid in aborts.get(step, []):
            engine.abort(rid)
        engine.step()
        step += 1
        assert step < 5000, "engine made no progress"
    return {rid: (outs.get(rid, []), reasons[rid]) for rid in reasons}, seqs


def workload(seed: int, n: int, vocab: int):
    """Requests over a few shared system prompts, some repeating a whole earlier prompt plus
    its answer (a growing conversation); staggered arrivals and a few aborts."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, vocab) for _ in range(rng.randint(9, 30))] for _ in range(3)]
    arrivals: dict[int, list] = {}
    aborts: dict[int, list] = {}
    for i in range(n):
        prompt = rng.choice(systems) + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 12))]
        step = rng.randrange(0, 3 * n)
        arrivals.setdefault(step, []).append((f"r{i}", prompt, rng.randint(1, 10)))
        if rng.random() < 0.15:
            aborts.setdefault(step + rng.randint(0, 6), []).append(f"r{i}")
    return arrivals, aborts


def engine_for(model, cache: bool, **kw) -> Engine:
    args = dict(
        model=str(model),
        device="cpu",
        kernel_backend="cpu",
        page_size=4,
        kv_pages=64,
        max_num_seqs=8,
        max_num_batched_tokens=48,
        enable_prefix_cache=cache,
    )
    args.update(kw)
    return Engine(EngineArgs(**args))


def assert_all_pages_back(engine: Engine) -> None:
    alloc, cache = engine.pool.allocator, engine.prefix_cache
    assert not engine.seqs and not engine.scheduler.running and not engine.scheduler.waiting
    assert alloc._refs == {}, f"pages still referenced: {alloc._refs}"
    assert alloc.num_free == engine.pool.num_pages
    if cache is not None:
        cache.check()
        assert cache.num_idle == cache.num_cached
        alloc.allocate(engine.pool.num_pages)  # evicts every cached page
        assert cache.num_cached == 0 and alloc.num_unused == 0


@pytest.mark.parametrize("pool", [64, 14], ids=["roomy", "preempting"])
def test_greedy_outputs_with_the_cache_equal_outputs_without(tiny_model, pool):
    """Concurrency (staggered batches), preemption (a 14-page pool) and aborts: every request
    that completes in both engines produced the same tokens."""
    vocab = 400
    arrivals, aborts = workload(3, 24, vocab)
    ref_engine = engine_for(tiny_model, False, kv_pages=pool)
    ref, _ = drive(ref_engine, arrivals, aborts)
    engine = engine_for(tiny_model, True, kv_pages=pool)
    got, seqs = drive(engine, arrivals, aborts)
    both = [rid for rid in ref if ref[rid][1] == "length" and got[rid][1] == "length"]
    assert len(both) >= 12
    for rid in both:
        assert got[rid][0] == ref[rid][0], rid
    stats = engine.prefix_cache.stats()
    assert stats["hit_tokens"] > 0.3 * stats["query_tokens"], stats
    if pool == 14:
        assert sum(s.num_preemptions for s in seqs) > 0, "the small pool should have forced preemption"
    assert_all_pages_back(engine)
    assert_all_pages_back(ref_engine)


def test_growing_conversation_reuses_the_previous_round(tiny_model):
    engine = engine_for(tiny_model, True, kv_pages=128, max_num_batched_tokens=256)
    rng = random.Random(5)
    convo = [rng.randrange(3, 400) for _ in range(40)]
    hits = []
    for rnd in range(4):
        out, _ = drive(engine, {0: [(f"round{rnd}", list(convo), 6)]}, {})
        hits.append(engine.scheduler.cache.hit_tokens)
        convo += out[f"round{rnd}"][0] + [rng.randrange(3, 400) for _ in range(10)]
    gained = [b - a for a, b in zip([0] + hits, hits)]
    assert gained[0] == 0 and all(g >= 40 for g in gained[1:]), gained
    assert_all_pages_back(engine)


def test_random_shared_prefixes_and_aborts_on_a_tiny_pool_return_every_page(tiny_model):
    """The engine's own thread, requests and aborts arriving from outside: at the end no page
    is referenced, every cached page is idle, and evicting them frees the whole pool."""
    import threading
    import time

    engine = engine_for(tiny_model, True, kv_pages=20, max_num_seqs=8, max_num_batched_tokens=40)
    rng = random.Random(11)
    systems = [[rng.randrange(3, 400) for _ in range(rng.randint(4, 26))] for _ in range(4)]
    n = 120
    done = threading.Event()
    finished: dict[str, str] = {}
    lock = threading.Lock()

    def sink(out):
        if out.finished:
            with lock:
                finished[out.rid] = out.finish_reason
                if len(finished) == n:
                    done.set()

    engine.start()
    try:
        for i in range(n):
            prompt = rng.choice(systems) + [rng.randrange(3, 400) for _ in range(rng.randint(0, 20))]
            params = SamplingParams(
                max_tokens=rng.randint(1, 16), temperature=rng.choice([0, 0.9]), ignore_eos=True, seed=rng.randint(0, 9)
            )
            engine.submit(Sequence(f"r{i}", prompt, params, sink=sink))
            if rng.random() < 0.3:
                engine.abort(f"r{rng.randint(max(0, i - 4), i)}")
            if rng.random() < 0.15:
                time.sleep(0.005)
        assert done.wait(240), f"only {len(finished)} of {n} requests finished"
        deadline = time.monotonic() + 10
        while engine.scheduler.has_work() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.stop()
    assert "abort" in set(finished.values()) and "length" in set(finished.values())
    assert engine.prefix_cache.hit_tokens > 0
    assert_all_pages_back(engine)
