"""The prefix cache per rank of a data-parallel-attention engine (`--dp-size N`), without a
model: the rank choice (a pure function), the scheduler placing requests by their cached prefix
on each rank's own tree, hits counted per rank, the KV events kept per engine, the per-rank
series on /metrics."""

from __future__ import annotations

import torch

from dsv4_engine.kv_cache import SlotAllocator, copy_snapshot
from dsv4_engine.kv_journal import KVJournal
from dsv4_engine.metrics import EngineMetrics
from dsv4_engine.models.state import StateSpec
from dsv4_engine.parallel.dp_cache import (
    CountedJournal,
    DPPrefixCache,
    dp_cache_refusal,
    own_snapshot_row,
    rank_snapshot_pools,
)
from dsv4_engine.parallel.dp_loads import RankMetrics, rank_loads
from dsv4_engine.parallel.dp_pages import DPPageAllocator, choose_rank
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.scheduler import Scheduler
from dsv4_engine.sequence import Sequence

PAGE = 4


def test_no_match_anywhere_is_load_by_kv_then_the_lower_rank():
    assert choose_rank([0, 0], [5, 9]) == 1
    assert choose_rank([0, 0, 0], [7, 7, 3]) == 0
    books = DPPageAllocator(2, 8)
    books.allocate(3, 0)
    assert books.least_loaded() == choose_rank([0, 0], books.free_per_rank()) == 1


def test_the_longest_cached_prefix_wins_within_the_slack_then_load_decides():
    assert choose_rank([3, 0], [10, 12], running=[1, 0]) == 0  # one request busier: reuse the prefix
    assert choose_rank([3, 0], [10, 12], running=[2, 0]) == 1  # two busier: past the slack (1)
    assert choose_rank([3, 0], [10, 12], running=[10, 8]) == 0  # slack 0.25 x mean 9 -> 2: within
    assert choose_rank([3, 0], [10, 12], running=[10, 6]) == 1  # 4 busier than a slack of 2
    assert choose_rank([3, 1], [10, 20], running=[2, 0]) == 1  # the shorter match within the slack
    assert choose_rank([2, 3], [10, 10], running=[0, 1]) == 1  # the longer match, though busier
    assert choose_rank([2, 2], [10, 10], running=[1, 0]) == 1  # equal matches: fewer running
    assert choose_rank([2, 2], [10, 11]) == 1  # ... then more free pages
    assert choose_rank([2, 2], [10, 10]) == 0  # a tie: the lower rank


def test_a_rank_that_cannot_hold_the_rest_of_the_request_is_passed_over():
    assert choose_rank([4, 0], [2, 8], need=8) == 1  # rank 0 would need 4 more pages, has 2
    assert choose_rank([4, 0], [4, 8], need=8) == 0
    assert choose_rank([1, 0], [1, 2], need=9) == 0  # none fits: the prefix anyway


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))


def test_requests_land_on_the_rank_that_holds_their_prefix_and_hits_count_there():
    books = DPPageAllocator(2, 16)
    cache = DPPrefixCache(books, PAGE)
    journal = KVJournal("test")
    cache.journal = journal
    sched = Scheduler(books, PAGE, max_num_seqs=8, max_num_batched_tokens=64, prefix_cache=cache)
    cache.running = lambda: sched.running  # as the engine wires it
    a, b = list(range(100, 113)), list(range(200, 213))  # two conversations' first rounds, 3 pages each
    sa, sb = seq("a", a), seq("b", b)
    sched.add(sa)
    sched.add(sb)
    sched.schedule()  # admitted together: a on rank 0, b on rank 1 (more free pages)
    ra, rb = books.rank_of(sa.pages[0]), books.rank_of(sb.pages[0])
    assert (ra, rb) == (0, 1)
    for s in (sa, sb):
        s.num_computed = s.num_tokens
        sched.computed(s)
        sched.remove(s)
        sched.release(s)
    assert [c.num_cached for c in cache.ranks] == [3, 3] and books.num_free == books.total
    # second rounds, b's first: the free pages are equal, so only the prefix can place b on rank 1
    b2, a2 = seq("b2", b + [7, 8, 9]), seq("a2", a + [7, 8, 9])
    sched.add(b2)
    sched.add(a2)
    sched.schedule()
    assert books.rank_of(b2.pages[0]) == 1 and books.rank_of(a2.pages[0]) == 0
    assert b2.num_cached_tokens == a2.num_cached_tokens == 12
    assert [c.hit_tokens for c in cache.ranks] == [12, 12] and cache.hit_tokens == 24
    assert cache.placed == [1, 1]
    # the same page on both ranks is one "stored" for the router, "evicted" only when both let go
    shared = list(range(300, 305))
    for s in (seq("s0", shared), seq("s1", shared)):
        sched.add(s)
    for b_ in sched.schedule():
        b_.seq.num_computed = b_.seq.num_tokens
        sched.computed(b_.seq, b_)
    cache.check()
    held = journal.snapshot()
    assert sum(len(v) for v in held["tiers"].values()) == cache.num_cached - 1, "one hash held on both ranks"
    loads = rank_loads(books, sched.running, cache)
    assert [r["running"] for r in loads] == [2, 2] and [r["prefix_cache_hit_tokens"] for r in loads] == [12, 12]
    m = EngineMetrics("mono", "m")
    RankMetrics().publish(m, loads)
    text = m.render().decode()
    assert 'dsv4:dp_rank_prefix_cache_hit_tokens_total{dp_rank="1",model_name="m",role="mono"} 12.0' in text
    assert 'dsv4:dp_rank_running_reqs{dp_rank="0",model_name="m",role="mono"} 2.0' in text


def test_a_hash_held_by_two_ranks_is_evicted_for_the_router_only_when_both_let_go():
    journal = KVJournal("test")
    counted = CountedJournal(journal)
    h = b"\x01" * 16
    counted.stored("device", h)
    counted.stored("device", h)
    counted.evicted("device", h)
    assert h.hex() in journal.held["device"]
    counted.evicted("device", h)
    assert h.hex() not in journal.held["device"]


def test_what_the_cache_per_rank_does_not_cover_yet_is_said_by_name():
    paged = StateSpec("latent", 2, (8,))
    ring = StateSpec("window", 2, (8,), kind="slot", slots=4)
    assert dp_cache_refusal([paged], "mono") is None and dp_cache_refusal([paged], "prefill") is None
    assert dp_cache_refusal([paged, ring], "mono") is None  # V4: snapshots per rank
    assert "--decode-local-prefill" in dp_cache_refusal([paged], "decode")


def test_slot_row_snapshots_are_taken_and_restored_on_the_rank_that_runs_the_request():
    """V4 at --dp-size 2: rank 0 keeps both ranks' snapshot books; rank 0's copies are made in its
    own rows, rank 1's travel (as wire.OP_SNAPSHOT does) to rank 1, which alone makes them."""
    rows = {"ring": torch.zeros(4, 3)}  # the slot rows: every rank has all of them
    rank1 = {"ring": torch.zeros(4, 3)}
    rank1_snaps = {"ring": torch.zeros(2, 3)}  # rank 1's own 2 snapshots
    sent = []

    def send(kind, snap, row):  # what rank 1's worker does with rank 0's message
        sent.append((kind, snap, row))
        mine = own_snapshot_row(snap, 1, 2)
        if mine is not None:
            copy_snapshot(rank1_snaps, rank1, kind, mine, row)

    assert own_snapshot_row(2, 0, 2) is None and own_snapshot_row(1, 0, 2) == 1 and own_snapshot_row(3, 1, 2) == 1
    books = DPPageAllocator(2, 16)
    cache = DPPrefixCache(books, PAGE, rank_snapshot_pools(rows, 2, 2, send), PAGE)
    sched = Scheduler(books, PAGE, 8, 64, slots=SlotAllocator(4), prefix_cache=cache)
    cache.running = lambda: sched.running
    a, b = list(range(100, 110)), list(range(200, 210))  # 10 tokens: snapshots at 4 and 8
    sa, sb = seq("a", a), seq("b", b)
    sched.add(sa)
    sched.add(sb)
    for _ in range(3):  # chunks end at each boundary: 4, 8, then the rest
        for x in sched.schedule():
            s = x.seq
            (rows if books.rank_of(s.pages[0]) == 0 else rank1)["ring"][s.slot] = s.num_computed + x.num_new
            s.num_computed += x.num_new
            sched.computed(s, x)
    assert (books.rank_of(sa.pages[0]), books.rank_of(sb.pages[0])) == (0, 1)
    assert sent and all(2 <= snap < 4 for _, snap, _ in sent), "only rank 1's snapshots travel"
    for s in (sa, sb):
        sched.remove(s)
        sched.release(s)
    assert [c.snapshots.num_used for c in cache.ranks] == [1, 1], "one per request: the last boundary's"
    rows["ring"].zero_()
    rank1["ring"].zero_()
    a2, b2 = seq("a2", a + [1, 2]), seq("b2", b + [1, 2])
    sched.add(a2)
    sched.add(b2)
    sched.schedule()
    assert a2.num_cached_tokens == b2.num_cached_tokens == 8
    assert books.rank_of(a2.pages[0]) == 0 and books.rank_of(b2.pages[0]) == 1
    assert rows["ring"][a2.slot].tolist() == [8.0] * 3, "rank 0 restored a's row at 8 in place"
    assert rank1["ring"][b2.slot].tolist() == [8.0] * 3, "rank 1 restored b's row at 8 itself"
    assert rows["ring"][b2.slot].tolist() == [0.0] * 3, "rank 0 makes no copy of rank 1's"
    assert cache.snapshots.num_used == 2 and cache.stats()["ranks"][1]["snapshots_restored"] == 1
    cache.check()
