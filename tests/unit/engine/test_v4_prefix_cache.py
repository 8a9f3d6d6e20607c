"""DeepSeek-V4 prefix reuse: cached pages up to a boundary plus a snapshot of the slot row (window
ring, compressor stages) there. The snapshot pool on its own, then real v4-tiny engines (sliding
window 8, CSA every 4 tokens, HCA every 8, indexer top-4): greedy outputs with the cache equal
outputs without it under staggered arrivals, aborts, preemption, chunked prefill at awkward
splits and prompts ending at, before and after window / compression / top-k boundaries; every
page, slot row and snapshot comes back; both pools evict under pressure."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from dsv4_engine.engine import Engine, default_snapshots
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.kv_cache import SnapshotPool, pages_for_memory, slot_row_nbytes, snapshot_boundary
from dsv4_engine.models.state import StateSpec
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence
from test_prefix_cache import drive

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 400


@pytest.fixture(scope="module")
def v4_dir(make_model):
    return make_model("v4-tiny")


def v4_engine(model, cache: bool, **kw) -> Engine:
    args = dict(
        model=str(model),
        device="cpu",
        kernel_backend="cpu",
        page_size=4,
        kv_pages=96,
        max_num_seqs=6,
        max_num_batched_tokens=13,
        enable_prefix_cache=cache,
        prefix_cache_snapshots=48,
    )
    args.update(kw)
    return Engine(EngineArgs(**args))


def assert_everything_back(engine: Engine) -> None:
    """No page referenced, every slot row free, the tree consistent; evicting every cached page
    gives back every snapshot too (no snapshot outlives its boundary's page)."""
    alloc, cache = engine.pool.allocator, engine.prefix_cache
    assert not engine.seqs and not engine.scheduler.running and not engine.scheduler.waiting
    assert alloc._refs == {}, f"pages still referenced: {alloc._refs}"
    assert alloc.num_free == engine.pool.num_pages
    assert engine.pool.slots.num_free == engine.pool.num_slots
    if cache is not None:
        cache.check()
        assert cache.num_idle == cache.num_cached
        alloc.allocate(engine.pool.num_pages)  # evicts every cached page
        assert cache.num_cached == 0 and alloc.num_unused == 0
        assert cache.snapshots.num_used == 0 and cache.snapshots.num_free == cache.snapshots.total
        cache.check()


# ---- the snapshot pool and the boundary ------------------------------------------------------


def test_snapshot_pool_copies_rows_and_gives_back_the_least_recently_used():
    rows = {"ring": torch.zeros(3, 2, 4), "stage": torch.zeros(3, 1, 2)}
    pool = SnapshotPool(rows, 2)
    evicted = []
    pool.on_evict = evicted.append
    rows["ring"][1] = 1.0
    rows["stage"][1] = 2.0
    a = pool.save(1)
    rows["ring"][2] = 3.0
    b = pool.save(2)
    pool.restore(a, 0)  # a is now the most recent
    assert torch.equal(rows["ring"][0], torch.ones(2, 4)) and torch.equal(rows["stage"][0], torch.full((1, 2), 2.0))
    rows["ring"][1] = 5.0  # the snapshot is a copy: the row moving on leaves it alone
    pool.restore(a, 2)
    assert torch.equal(rows["ring"][2], torch.ones(2, 4))
    c = pool.save(1)  # full: b (least recently used) goes
    assert evicted == [b] and c == b and pool.holds(a) is not False
    assert pool.num_used == 2 and pool.evicted == 1
    assert pool.bytes_per_snapshot() == {"ring": 32, "stage": 8}
    pool.drop(a)
    with pytest.raises(RuntimeError, match="dropped twice"):
        pool.drop(a)
    with pytest.raises(RuntimeError, match="not held"):
        pool.restore(a, 0)


def test_boundary_is_a_multiple_of_the_page_and_of_every_compression_window():
    csa = StateSpec("csa", 1, (4,), tokens_per_entry=4)
    hca = StateSpec("hca", 1, (4,), tokens_per_entry=128)
    ring = StateSpec("ring", 1, (4,), kind="slot", slots=128)
    assert snapshot_boundary([csa, hca, ring], 128) == 128
    assert snapshot_boundary([csa, hca, ring], 16) == 128  # pages shorter than HCA's window
    assert snapshot_boundary([csa, ring], 16) == 16
    assert snapshot_boundary([StateSpec("c", 1, (4,), tokens_per_entry=8)], 4) == 8


def test_snapshots_come_out_of_the_memory_budget(v4_dir):
    e = v4_engine(v4_dir, True, kv_pages=None, kv_memory_gb=0.01, prefix_cache_snapshots=None)
    specs, dt = e.runner.state_specs, e.runner.dtype
    assert e.prefix_cache.snapshots.total == default_snapshots(6) == 24
    assert e.pool.num_pages == pages_for_memory(specs, 4, dt, 0.01, 6, 24) < pages_for_memory(specs, 4, dt, 0.01, 6)
    off = v4_engine(v4_dir, False, kv_pages=None, kv_memory_gb=0.01)
    assert off.pool.num_pages == pages_for_memory(specs, 4, dt, 0.01, 6)
    assert slot_row_nbytes(specs, dt) == sum(e.prefix_cache.snapshots.bytes_per_snapshot().values())


# ---- real engines ------------------------------------------------------------------------------


def workload(seed: int, n: int):
    """Shared system prompts of every length class (before, at and after the window of 8, the
    CSA/HCA windows of 4/8, the 16-token boundary, and past top-4 of CSA entries), requests that
    re-send a whole earlier prompt (exact repeats), staggered arrivals and a few aborts."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, VOCAB) for _ in range(k)] for k in (7, 8, 9, 16, 17, 24, 31, 33, 45)]
    arrivals: dict[int, list] = {}
    aborts: dict[int, list] = {}
    sent: list[list[int]] = []
    for i in range(n):
        if sent and rng.random() < 0.15:
            prompt = list(rng.choice(sent))
        else:
            prompt = rng.choice(systems) + [rng.randrange(3, VOCAB) for _ in range(rng.choice([0, 1, 3, 8, 9, 16, 17]))]
        sent.append(prompt)
        step = rng.randrange(0, 4 * n)
        arrivals.setdefault(step, []).append((f"r{i}", prompt, rng.randint(1, 12)))
        if rng.random() < 0.12:
            aborts.setdefault(step + rng.randint(0, 8), []).append(f"r{i}")
    return arrivals, aborts


def rows_only(engine: Engine) -> Engine:
    """The kernel path's way (no snapshots written inside a chunk): the scheduler ends a chunk at
    a prompt's branch point and last boundary, and the row is copied after the step."""
    engine.prefix_cache.in_forward, engine.prefix_cache.interval = False, 0
    return engine


@pytest.mark.parametrize(
    "page_size,pool,in_forward",
    [
        pytest.param(4, 96, True, id="page4-roomy"),
        pytest.param(4, 96, False, id="page4-rows-only", marks=pytest.mark.slow),
        pytest.param(4, 22, True, id="page4-preempting"),
        pytest.param(16, 24, True, id="page16", marks=pytest.mark.slow),
    ],
)
def test_greedy_outputs_with_the_cache_equal_outputs_without(v4_dir, page_size, pool, in_forward):
    """Page 4 (boundary 8: pages shorter than the HCA window, so a page is not final when its own
    tokens are) and page 16 (the preset's default); a 13-token step budget splits chunks at
    awkward places; the 22-page pool forces preemption. Snapshots written by the forward inside
    chunks (every 16 tokens here), or only from the row at chunk ends (the kernel path's way)."""
    arrivals, aborts = workload(3, 28)
    ref_engine = v4_engine(v4_dir, False, page_size=page_size, kv_pages=pool)
    ref, _ = drive(ref_engine, arrivals, aborts)
    engine = v4_engine(v4_dir, True, page_size=page_size, kv_pages=pool, prefix_cache_snapshot_interval=16)
    if not in_forward:
        rows_only(engine)
    got, seqs = drive(engine, arrivals, aborts)
    both = [rid for rid in ref if ref[rid][1] == "length" and got[rid][1] == "length"]
    assert len(both) >= 18
    for rid in both:
        assert got[rid][0] == ref[rid][0], rid
    stats = engine.prefix_cache.stats()
    assert stats["boundary_tokens"] == max(8, page_size)
    assert stats["hit_tokens"] > (0.3 if pool == 96 else 0.1) * stats["query_tokens"], stats
    assert stats["snapshots_restored"] > 5, stats
    reused = [s for s in seqs if s.num_cached_tokens]
    assert all(s.num_cached_tokens % stats["boundary_tokens"] == 0 for s in reused)
    if pool == 22:
        assert sum(s.num_preemptions for s in seqs) > 0, "the small pool should have forced preemption"
    assert_everything_back(engine)
    assert_everything_back(ref_engine)


def test_a_snapshot_written_inside_a_chunk_equals_the_row_at_that_boundary(v4_dir):
    """The torch path's in-forward snapshot at 16 of a 40-token chunk holds what the slot row
    holds when a chunk ends at 16: every slot state, every layer, every ring offset."""
    prompt = list(range(7, 47))
    inside = v4_engine(v4_dir, True, max_num_batched_tokens=64, prefix_cache_snapshot_interval=16)
    assert inside.prefix_cache.in_forward and inside.prefix_cache.interval == 16
    drive(inside, {0: [("a", prompt, 1)]}, {})
    at_end = rows_only(v4_engine(v4_dir, True, max_num_batched_tokens=16))
    drive(at_end, {0: [("a", prompt, 1)]}, {})

    def snapshot_at(engine: Engine, pos: int) -> dict:
        cache = engine.prefix_cache
        node = next(n for n in cache._by_snapshot.values() if n.depth * 4 == pos)
        return {k: t[node.snapshot] for k, t in cache.snapshots.states.items()}

    a, b = snapshot_at(inside, 16), snapshot_at(at_end, 16)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-5, msg=name)
    assert any(a[name].abs().sum() > 0 for name in a)


def test_every_boundary_class_resumes_exactly(v4_dir):
    """One conversation prefix cut at each length around the window (8), compression (4, 8),
    boundary (8 at page 4) and top-k (past 4 CSA entries = 16 tokens) edges, each sent after
    the longer ones are cached: it resumes at the deepest snapshot before its last token."""
    rng = random.Random(9)
    base = [rng.randrange(3, VOCAB) for _ in range(64)]
    lengths = [64, 7, 8, 9, 15, 16, 17, 23, 24, 25, 31, 32, 33, 47, 48, 49, 57, 64]
    arrivals = {3 * i: [(f"L{i}-{n}", base[:n], 5)] for i, n in enumerate(lengths)}
    ref, _ = drive(v4_engine(v4_dir, False, max_num_batched_tokens=64), arrivals, {})
    engine = v4_engine(v4_dir, True, max_num_batched_tokens=64)
    got, seqs = drive(engine, arrivals, {})
    assert got == ref
    hit = {s.rid: s.num_cached_tokens for s in seqs}
    assert hit["L0-64"] == 0
    # The 64-token prompt left snapshots at 56 (its last boundary before its last token) and 64 (its
    # prefill's end). Prompts of at most one boundary reuse nothing (the last token is always
    # computed); the 8-token one leaves a snapshot at its end, where the 9-token one resumes. The
    # others resume at a boundary (never at their last token), at most one boundary short of
    # their last one: each leaves a snapshot where it branches off the cached path and at its own
    # last boundary.
    assert hit["L1-7"] == hit["L2-8"] == 0 and hit["L3-9"] == 8
    assert hit["L16-57"] == hit["L17-64"] == 56
    for rid, h in hit.items():
        n = int(rid.split("-")[1])
        last = (n - 1) // 8 * 8
        assert h % 8 == 0 and h <= last and (n <= 9 or rid == "L0-64" or h >= last - 8), (rid, h)
    assert_everything_back(engine)


def test_a_growing_conversation_resumes_inside_the_previous_answer(v4_dir):
    """Round N+1 re-sends round N's prompt and answer: the snapshot taken at the answer's latest
    boundary serves it, so it recomputes at most one boundary of old tokens."""
    rng = random.Random(5)
    convo = [rng.randrange(3, VOCAB) for _ in range(30)]
    ref_engine = v4_engine(v4_dir, False, kv_pages=128, max_num_batched_tokens=256)
    engine = v4_engine(v4_dir, True, kv_pages=128, max_num_batched_tokens=256)
    for rnd in range(4):
        want, _ = drive(ref_engine, {0: [(f"round{rnd}", list(convo), 12)]}, {})
        got, seqs = drive(engine, {0: [(f"round{rnd}", list(convo), 12)]}, {})
        assert got == want, rnd
        if rnd:
            assert seqs[0].num_cached_tokens >= len(convo) - 12 - 10 - 8, (rnd, seqs[0].num_cached_tokens, len(convo))
        convo += got[f"round{rnd}"][0] + [rng.randrange(3, VOCAB) for _ in range(10)]
    # One decode snapshot per answer: the earlier decode boundaries of an answer were dropped.
    stats = engine.prefix_cache.stats()
    assert stats["snapshots_cached"] <= 3 * 4, stats
    assert_everything_back(engine)


def test_random_shared_prefixes_aborts_and_tiny_pools_return_everything(v4_dir):
    """The engine's own thread; 18 pages and 3 snapshots for 6 running requests: both pools
    evict under pressure, rows are preempted and re-admitted, aborts land anywhere. At the end
    every page, slot row and snapshot is back."""
    engine = v4_engine(v4_dir, True, kv_pages=18, max_num_seqs=6, max_num_batched_tokens=21, prefix_cache_snapshots=3)
    rng = random.Random(11)
    systems = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 40))] for _ in range(5)]
    n = 90
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
            prompt = rng.choice(systems) + [rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 20))]
            params = SamplingParams(
                max_tokens=rng.randint(1, 24), temperature=rng.choice([0, 0.9]), ignore_eos=True, seed=rng.randint(0, 9)
            )
            engine.submit(Sequence(f"r{i}", prompt, params, sink=sink))
            if rng.random() < 0.3:
                engine.abort(f"r{rng.randint(max(0, i - 4), i)}")
            if rng.random() < 0.2:
                time.sleep(0.01)
        assert done.wait(300), f"only {len(finished)} of {n} requests finished"
        deadline = time.monotonic() + 10
        while engine.scheduler.has_work() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.stop()
    assert "abort" in set(finished.values()) and "length" in set(finished.values())
    stats = engine.prefix_cache.stats()
    assert stats["hit_tokens"] > 0 and stats["snapshots_restored"] > 0, stats
    assert stats["snapshots_evicted"] > 0, stats  # the snapshot pool's LRU ran
    assert_everything_back(engine)


def test_page_eviction_drops_the_snapshot_of_its_boundary(v4_dir):
    """Pages evicted under pressure take their boundary's snapshot with them, and a later
    request resumes only where a snapshot survives (never from pages alone)."""
    engine = v4_engine(v4_dir, True, kv_pages=12, max_num_batched_tokens=64)
    rng = random.Random(2)
    a = [rng.randrange(3, VOCAB) for _ in range(33)]
    drive(engine, {0: [("a", a, 2)]}, {})
    cache = engine.prefix_cache
    assert cache.snapshots.num_used == 1  # at 32 (the prompt's last boundary) and nowhere else
    b = [rng.randrange(3, VOCAB) for _ in range(40)]  # needs 10 of the 12 pages: evicts a's leaves
    drive(engine, {0: [("b", b, 2)]}, {})
    cache.check()
    ref, _ = drive(v4_engine(v4_dir, False, kv_pages=12), {0: [("a2", a + [7], 3)]}, {})
    got, seqs = drive(engine, {0: [("a2", a + [7], 3)]}, {})
    assert got == ref
    assert seqs[0].num_cached_tokens in (0, 8, 16, 24, 32)
    assert_everything_back(engine)


def test_loads_and_metrics_say_what_the_cache_holds_per_state(v4_dir):
    engine = v4_engine(v4_dir, True, kv_pages=64, max_num_batched_tokens=64)
    prompt = list(range(5, 45))
    drive(engine, {0: [("a", prompt, 3)], 4: [("b", prompt + [9], 3)]}, {})
    engine.update_gauges()
    pc = engine.loads()["prefix_cache"]
    assert pc["enabled"] and pc["boundary_tokens"] == 8 and pc["snapshots_cached"] >= 1
    held = pc["bytes_by_state"]
    assert set(held) == {*engine.pool.states, *engine.pool.slot_states}
    for name, nbytes in engine.pool.bytes_per_request().items():
        assert held[name] == nbytes * pc["snapshots_cached"], name
    for name, nbytes in engine.pool.page_bytes_by_state().items():
        assert held[name] == nbytes * pc["pages_cached"], name
    text = engine.metrics.render().decode()
    name = engine.args.served_model_name  # the checkpoint folder's name by default
    assert f'dsv4:prefix_cache_snapshots{{model_name="{name}",role="mono"}} {float(pc["snapshots_cached"])}' in text
    assert f'dsv4:prefix_cache_state_bytes{{model_name="{name}",role="mono",state="swa_kv"}}' in text
    assert engine.seqs == {}
