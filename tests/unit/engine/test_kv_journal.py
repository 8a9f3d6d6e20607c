"""The engine's KV cache events (kv_journal.KVJournal fed by the prefix cache), without I/O: a
subscriber that folds the snapshot and the batches (the contract's reference `EngineView`) holds
exactly the hashes of the pages the cache holds, and those are the contract's `page_hashes` of
the prompt (salted, and with boundaries longer than a page, as DeepSeek-V4 keys them)."""

from __future__ import annotations

from dsv4_engine.kv_cache import PageAllocator
from dsv4_engine.kv_journal import KVJournal
from dsv4_engine.prefix_cache import PrefixCache
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence
from dsv4_wire import kv_events as wire

PS = 4


def seq(rid: str, tokens: list[int], salt=None) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=4, temperature=0, cache_salt=salt))


def run(cache: PrefixCache, alloc: PageAllocator, s: Sequence) -> None:
    """Attach, compute every token, cache the pages, give them back (a finished request)."""
    cache.attach(s)
    need = -(-s.num_tokens // PS) - len(s.pages)
    s.pages.extend(alloc.allocate(need))
    s.num_computed = s.num_tokens
    cache.insert(s)
    alloc.free(s.pages)
    s.pages = []
    cache.forget(s)


def cached_hashes(cache: PrefixCache) -> set[str]:
    return {n.hash.hex() for n in cache._by_page.values()}


def view_of(journal: KVJournal, page_size: int = PS) -> wire.EngineView:
    snap = journal.snapshot()
    v = wire.EngineView()
    msg = wire.snapshot_message(
        journal.instance, snap["seq"], snap["tiers"], model="m", role="mono", page_size=page_size, boundary_tokens=PS
    )
    assert v.apply(wire.decode(wire.encode(msg)))
    return v


def follow(v: wire.EngineView, journal: KVJournal) -> None:
    for msg in journal.since(v.seq):
        assert v.apply(wire.decode(wire.encode(msg))), msg


def test_a_subscriber_holds_what_the_cache_holds_through_stores_and_evictions():
    alloc = PageAllocator(6)
    cache = PrefixCache(alloc, PS)
    journal = cache.journal = KVJournal("i1")
    v = view_of(journal)
    assert v.tiers["device"] == set() and v.seq == 1  # batch 1: every tier cleared at start
    a = list(range(100, 113))  # 3 full pages
    run(cache, alloc, seq("a", a))
    follow(v, journal)
    assert v.tiers["device"] == cached_hashes(cache) == {h.hex() for h in wire.page_hashes(a, PS)}
    assert v.matched_pages([h.hex() for h in wire.page_hashes(a + [1, 2, 3, 4], PS)]) == 3
    # another prompt needs the room: a's least recently used leaves go, and the stream says so
    b = list(range(200, 217))  # 4 full pages + a partial one, of 6: two of a's must go
    run(cache, alloc, seq("b", b))
    follow(v, journal)
    assert v.tiers["device"] == cached_hashes(cache)
    assert len(v.tiers["device"]) == 5 and v.matched_pages([h.hex() for h in wire.page_hashes(a, PS)]) == 1
    # a late subscriber's snapshot agrees with the one that followed every batch
    assert view_of(journal).tiers == v.tiers
    assert journal.since(v.seq) == []


def test_salted_and_boundary_keyed_pages_hash_as_the_contract_says():
    alloc = PageAllocator(32)
    cache = PrefixCache(alloc, PS, boundary=2 * PS)  # V4-like: a page's key runs to the boundary
    journal = cache.journal = KVJournal("i1")
    toks = list(range(7, 7 + 4 * PS + 1))
    run(cache, alloc, seq("s", toks, salt="tenant-a"))
    run(cache, alloc, seq("n", toks))
    want = {h.hex() for h in wire.page_hashes(toks, PS, 2 * PS, "tenant-a")}
    want |= {h.hex() for h in wire.page_hashes(toks, PS, 2 * PS)}
    assert len(want) == 8 and journal.snapshot()["tiers"]["device"] == sorted(want)


def test_a_reader_too_far_behind_must_resync():
    alloc = PageAllocator(64)
    cache = PrefixCache(alloc, PS)
    journal = cache.journal = KVJournal("i1", keep=3)
    for k in range(5):
        run(cache, alloc, seq(str(k), [k] * (PS + 1)))
        journal.snapshot()  # a read cuts a batch
    assert journal.since(1) is None  # batches 2.. are partly gone
    assert journal.since(journal.seq + 1) is None  # ahead of this journal: another instance
    assert [m["seq"] for m in journal.since(journal.seq - 2)] == [journal.seq - 1, journal.seq]
