"""cache_salt (vLLM's prefix-cache isolation): requests with different salts, or one salted and
one not, share no cached page; the same salt shares as an unsalted cache does."""

from __future__ import annotations

from dsv4_engine.kv_cache import PageAllocator
from dsv4_engine.prefix_cache import PrefixCache
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence

PS = 4


def seq(rid: str, tokens: list[int], salt: str | None) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=4, temperature=0, cache_salt=salt))


def computed(cache: PrefixCache, alloc: PageAllocator, s: Sequence) -> Sequence:
    s.pages.extend(alloc.allocate(-(-s.num_tokens // PS) - len(s.pages)))
    s.num_computed = s.num_tokens
    cache.insert(s)
    return s


def test_salts_share_no_page_and_one_salt_shares_its_own():
    alloc = PageAllocator(32)
    cache = PrefixCache(alloc, PS)
    prompt = list(range(13))  # 3 full pages reusable
    a = computed(cache, alloc, seq("a", prompt, "tenant-a"))
    assert cache.num_cached == 3
    for salt in ("tenant-b", None, "tenant-a "):
        other = seq("x", prompt, salt)
        assert cache.attach(other) == 0 and other.pages == [], salt
    again = seq("a2", prompt, "tenant-a")
    assert cache.attach(again) == 12 and again.pages == a.pages[:3]
    # The other salt's copy is a tree of its own; both coexist and evict independently.
    b = computed(cache, alloc, seq("b", prompt, "tenant-b"))
    assert set(b.pages).isdisjoint(a.pages) and cache.num_cached == 6
    cache.check()


def test_a_salt_is_never_confused_with_a_token():
    alloc = PageAllocator(16)
    cache = PrefixCache(alloc, PS)
    computed(cache, alloc, seq("a", [1, 2, 3, 4, 5], None))
    # A salt spelled like the first token id is still a different key.
    s = seq("s", [1, 2, 3, 4, 5], "1")
    assert cache.attach(s) == 0
