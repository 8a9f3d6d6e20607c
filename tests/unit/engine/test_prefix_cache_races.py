"""The prefix cache at its edges: requests that compute the same prefix at the same time (the
16-conversations-at-once workload of the benchmark), on the tree alone and in a real engine."""

from __future__ import annotations

import random

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.kv_cache import PageAllocator
from dsv4_engine.prefix_cache import PrefixCache
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence

from test_prefix_cache import PS, compute, release, seq  # noqa: E402  (the same request steps)


def test_a_request_that_loses_the_race_takes_the_cached_page_and_keeps_caching_its_own():
    """a and b share 8 tokens and both miss (admitted together). a caches the shared pages first;
    b must not stop there: its own later pages (its suffix, and next its answer, which the next
    round of its conversation re-sends) are worth caching too. b swaps its duplicate pages for
    a's (same tokens after the same prefix: the same KV) and extends the chain."""
    alloc = PageAllocator(16)
    cache = PrefixCache(alloc, PS)
    a, b = seq("a", list(range(8)) + [50, 51, 52, 53, 54]), seq("b", list(range(8)) + [60, 61, 62, 63, 64])
    cache.attach(a)
    cache.attach(b)
    compute(cache, alloc, a, 13)
    compute(cache, alloc, b, 13)
    assert b.pages[:2] == a.pages[:2] and all(alloc.refcount(p) == 2 for p in a.pages[:2])
    assert b.num_cached_pages == 3 and cache.num_cached == 4  # 2 shared + a's and b's third pages
    assert alloc.num_unused == 16 - 6  # a's 4 pages, b's 2 own: b's duplicates went back at once
    cache.check()
    release(cache, alloc, a)
    cache.check()
    c = seq("c", list(b.prompt_ids) + [1])
    assert cache.attach(c) == 12 and c.pages == b.pages[:3]
    for s in (b, c):
        release(cache, alloc, s)
    cache.check()
    assert alloc._refs == {} and alloc.num_free == 16
    assert alloc.allocate(16) is not None and cache.num_cached == 0  # every idle page evictable


def engine_for(model, cache: bool) -> Engine:
    return Engine(
        EngineArgs(
            model=str(model),
            device="cpu",
            kernel_backend="cpu",
            page_size=PS,
            kv_pages=160,
            max_num_seqs=8,
            max_num_batched_tokens=1024,
            enable_prefix_cache=cache,
        )
    )


def run_round(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    outs: list[list[int]] = [[] for _ in prompts]
    seqs = []
    for i, p in enumerate(prompts):
        s = Sequence(
            f"c{i}-{engine.scheduler.cache.query_tokens if engine.scheduler.cache else 0}",
            list(p),
            SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
            sink=lambda o, i=i: outs[i].extend(o.token_ids),
        )
        seqs.append(s)
        engine.submit(s)
    for _ in range(500):
        if all(s.finished for s in seqs):
            return outs
        engine.step()
    raise AssertionError("no progress")


def test_conversations_admitted_together_each_reuse_their_own_previous_round(tiny_model):
    """8 conversations over one system prompt, all admitted in one step: round 2 of every one
    reuses all of its round 1 (prompt and answer, full pages), not just the system prompt,
    and the tokens equal an engine without the cache."""
    rng = random.Random(7)
    system = [rng.randrange(3, 400) for _ in range(16)]
    convos = [system + [rng.randrange(3, 400) for _ in range(9)] for _ in range(8)]
    engine, ref = engine_for(tiny_model, True), engine_for(tiny_model, False)
    for rnd in range(2):
        before = engine.prefix_cache.hit_tokens
        got = run_round(engine, convos, 7)
        assert got == run_round(ref, convos, 7), rnd
        if rnd == 1:
            # Round 1 computed 25 prompt + 6 answer tokens (the last answer token never gets KV):
            # 7 full pages of 4, all of them reused (without the swap: the system prompt only).
            assert engine.prefix_cache.hit_tokens - before == 8 * 28, engine.prefix_cache.stats()
        convos = [c + o + [rng.randrange(3, 400) for _ in range(3)] for c, o in zip(convos, got)]
    assert engine.pool.allocator._refs == {}
    engine.prefix_cache.check()


def test_random_races_preemptions_and_releases_keep_every_page_accounted_for():
    """A 3-token vocabulary makes requests collide on the same pages all the time (swaps), on
    pools of 6 to 30 pages (eviction, failed allocations taken as preemptions). After every
    operation the tree agrees with the allocator and each page is referenced, free or idle in
    the cache, never lost; at the end every page comes back and every cached page is evictable."""
    for seed in range(12):
        rng = random.Random(seed)
        total = rng.randint(6, 30)
        alloc = PageAllocator(total)
        cache = PrefixCache(alloc, PS)
        bases = [[rng.randrange(3) for _ in range(24)] for _ in range(3)]
        live: list[Sequence] = []

        def drop(s: Sequence) -> None:
            if s in live:
                live.remove(s)
            release(cache, alloc, s)

        for t in range(2500):
            op = rng.random()
            if op < 0.3 and len(live) < 6:  # admission: reuse, then room for one token
                s = seq(
                    f"s{t}",
                    rng.choice(bases)[: rng.randint(1, 24)] + [rng.randrange(3) for _ in range(rng.randint(0, 6))],
                )
                cache.attach(s)
                pages = alloc.allocate(max(0, -(-(s.num_computed + 1) // PS) - len(s.pages)))
                if pages is None:
                    drop(s)
                else:
                    s.pages += pages
                    live.append(s)
            elif op < 0.8 and live:  # a step: computes up to 6 tokens, sampling as it goes
                s = rng.choice(live)
                n = rng.randint(1, 6)
                s.output_ids += [rng.randrange(3) for _ in range(s.num_computed + n - s.num_tokens)]
                pages = alloc.allocate(max(0, -(-(s.num_computed + n) // PS) - len(s.pages)))
                if pages is None:
                    drop(s)  # preempted
                else:
                    s.pages += pages
                    s.num_computed += n
                    cache.insert(s)
                    assert len(set(s.pages)) == len(s.pages)
            elif live:  # finish or abort
                drop(rng.choice(live))
            cache.check()
            held = sum(1 for p in range(total) if alloc.refcount(p) > 0)
            assert held + alloc.num_free == total, (seed, t)
        for s in list(live):
            drop(s)
        cache.check()
        assert alloc._refs == {} and alloc.num_free == total
        assert alloc.allocate(total) is not None and cache.num_cached == 0
