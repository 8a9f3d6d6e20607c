"""Sessions' pins on their own and inside the prefix cache (no I/O, a fake clock): a named
conversation's chain outlives a burst of other prompts for its TTL, then is plain LRU again;
running work still gets every idle page (pinned ones last); a tenant pins at most its share;
DELETE is per tenant."""

from __future__ import annotations

import pytest

from dsv4_engine.kv_cache import PageAllocator
from dsv4_engine.prefix_cache import PrefixCache
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence
from dsv4_engine.session_pins import SessionPins, check_ttl, session_refusal

PS = 4


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def seq(rid, tokens, session=None, salt=None, ttl=None) -> Sequence:
    p = SamplingParams(max_tokens=4, temperature=0, cache_salt=salt, session=session, session_ttl=ttl)
    return Sequence(rid, list(tokens), p)


def run(cache: PrefixCache, alloc: PageAllocator, s: Sequence) -> int:
    """A request from admission to finish; the tokens it found cached."""
    hit = cache.attach(s)
    need = -(-s.num_tokens // PS) - len(s.pages)
    got = alloc.allocate(need)
    assert got is not None
    s.pages.extend(got)
    s.num_computed = s.num_tokens
    cache.insert(s)
    alloc.free(s.pages)
    s.pages = []
    cache.forget(s)
    return hit


def build(pages=12, ttl=30.0, share=1.0):
    clock = Clock()
    alloc = PageAllocator(pages)
    cache = PrefixCache(alloc, PS)
    cache.pins = SessionPins(pages, ttl, share, clock)
    return clock, alloc, cache


CONV = list(range(100, 117))  # 4 full pages + 1


def burst(cache, alloc, k0, n=3):
    for k in range(k0, k0 + n):
        run(cache, alloc, seq(f"o{k}", [1000 * (k + 1) + i for i in range(4 * PS + 1)]))


def test_a_named_conversation_survives_a_burst_for_its_ttl_an_unnamed_one_does_not():
    for session, kept in (("agent-1", 16), (None, 0)):
        clock, alloc, cache = build()
        run(cache, alloc, seq("r1", CONV, session))
        burst(cache, alloc, 0)  # 15 pages asked of 12: without a pin the conversation goes first
        clock.t = 10
        assert run(cache, alloc, seq("r2", CONV + [1, 2, 3], session)) == kept
        cache.check()


def test_pins_end_by_ttl_and_running_work_never_waits_on_one():
    clock, alloc, cache = build(ttl=5)
    run(cache, alloc, seq("r1", CONV, "a"))
    assert cache.pins.num_pinned == 4
    clock.t = 6  # expired: plain LRU again
    burst(cache, alloc, 0)
    assert run(cache, alloc, seq("r2", CONV + [1], "a")) == 0
    # a pin never blocks an allocation: every idle page, pinned ones last, is still free
    clock, alloc, cache = build()
    run(cache, alloc, seq("r1", CONV, "a"))
    big = alloc.allocate(12)
    assert big is not None and cache.pins.num_pinned == 0 and cache.pins.pages_dropped == 4
    alloc.free(big)


def test_a_tenant_pins_at_most_its_share_and_past_it_is_plain_lru():
    clock, alloc, cache = build(share=0.5)  # 6 of 12 pages
    run(cache, alloc, seq("a", CONV, "s1", salt="t1"))  # 4 pages
    run(cache, alloc, seq("b", [7] * 9, "s2", salt="t1"))  # 2 more: 6, at the cap
    run(cache, alloc, seq("c", [8] * 9, "s3", salt="t1"))  # past it: refused
    assert cache.pins.tenant_pages("t1") == 6 and cache.pins.pins_refused == 1
    run(cache, alloc, seq("d", [9] * 9, "s1", salt="t2"))  # another tenant has its own share
    assert cache.pins.tenant_pages("t2") == 2 and ("t2", "s1") in cache.pins.sessions


def test_delete_is_per_tenant_and_unknown_is_false():
    clock, alloc, cache = build()
    run(cache, alloc, seq("a", CONV, "s1", salt="t1"))
    assert not cache.pins.delete(("t2", "s1"))  # another tenant: as if unknown
    assert not cache.pins.delete(("t1", "nope"))
    assert cache.pins.num_pinned == 4
    assert cache.pins.delete(("t1", "s1"))
    assert cache.pins.num_pinned == 0 and not cache.pins.delete(("t1", "s1"))


def test_ttl_and_share_out_of_range_are_refused():
    with pytest.raises(ValueError, match="at most 3600"):
        check_ttl(0)
    with pytest.raises(ValueError, match="at most 3600"):
        check_ttl(4000)
    assert "--session-ttl" in session_refusal(-1, 0.5)
    assert "--session-pin-share" in session_refusal(30, 1.5)
    assert session_refusal(30, 0.5) is None
