"""The prefix cache of a data-parallel-attention engine (`--dp-size N`): one cache per rank.

Rank r's KV lives only in rank r's pages (`dp_pages`), so a cached prefix is reusable only by a
request that runs on r: each rank keeps its own radix tree (`PrefixCache`) over its own pool,
in the engine's global page ids. `DPPrefixCache` puts the N trees behind the one interface the
scheduler and the engine use. When a request is admitted it looks its prefix up in every rank's
tree and `choose_rank` picks where it runs (the longest match weighed against each rank's load);
it takes the pages of its match there, and every later page comes from the same rank (a
request's rank is the rank of its first page).

KV events (/v1/kv_events, the router's index) stay per engine: a page hash is "stored" when the
first rank caches it and "evicted" when the last rank holding it lets it go (`CountedJournal`),
so the router's contract is unchanged (it routes to engines; the engine picks the rank).

DeepSeek-V4 (slot states: window ring, compressor stages) resumes only at a boundary whose node
holds a snapshot of the slot row (`prefix_cache`). Each rank's tree has its own `SnapshotPool`
(its own LRU; --prefix-cache-snapshots counts per rank, as --kv-pages does): snapshot `s` of
rank r is `r * n + s` among the engine's snapshot ids. Rank 0 keeps every pool's books; each copy goes over the control channel
(`wire.OP_SNAPSHOT`) and only the rank that runs the request (the rank of its pages) makes it,
into the snapshot rows it holds (`own_snapshot_row`) from the request's slot row.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from dsv4_engine.kv_cache import SnapshotPool
from dsv4_engine.parallel.dp_pages import DPPageAllocator, choose_rank
from dsv4_engine.prefix_cache import PrefixCache
from dsv4_engine.sequence import Sequence


def dp_cache_refusal(specs: list, role: str) -> Optional[str]:
    """Why a --dp-size > 1 engine runs without a prefix cache per rank, in one line, or None.
    (A PD decode's --decode-local-prefill defaults on: it is turned off, said in /v1/loads.)"""
    if role == "decode":
        return "--decode-local-prefill is not yet supported at --dp-size > 1 (its lookup spans one rank's cache)"
    return None


def own_snapshot_row(snap: int, rank: int, per_rank: int) -> Optional[int]:
    """Where rank `rank` keeps the engine's snapshot `snap` among its own `per_rank` rows; None
    when the snapshot is another rank's (that rank makes the copy, this one skips it)."""
    owner, row = divmod(snap, per_rank)
    return row if owner == rank else None


def rank_snapshot_pools(slot_states: dict, per_rank: int, dp_size: int, send) -> list[SnapshotPool]:
    """One SnapshotPool per rank, all kept on rank 0. Rank 0's own copies its slot rows in place.
    Another rank's holds the books only (its rows and slot rows on the meta device: shapes for
    the byte counts, no memory, copies that do nothing) and `send`s each copy (the engine's
    snapshot id, the slot row) to that rank, which makes it."""
    pools = [SnapshotPool(slot_states, per_rank)]
    # every rank's rows (global ids) on the meta device: rank r's copies index them, then send them
    shapes = {
        name: torch.empty(dp_size * t.shape[0], *t.shape[1:], dtype=t.dtype, device="meta")
        for name, t in slot_states.items()
    }
    for r in range(1, dp_size):
        pool = SnapshotPool(shapes, per_rank)
        pool.mirror = lambda kind, snap, row, base=r * per_rank: send(kind, base + snap, row)
        pools.append(pool)
    return pools


class RankSnapshots:
    """What the engine and the scheduler read of the snapshots of every rank's cache, summed."""

    def __init__(self, pools: list[SnapshotPool]):
        self.pools = pools

    @property
    def num_used(self) -> int:
        return sum(p.num_used for p in self.pools)

    @property
    def total(self) -> int:
        return sum(p.total for p in self.pools)


class _LocalKeeper:
    """What rank r's PageAllocator asks of its cache (local page ids), answered by a cache that
    speaks global ids."""

    def __init__(self, cache: PrefixCache, base: int):
        self.cache, self.base = cache, base

    @property
    def num_idle(self) -> int:
        return self.cache.num_idle

    def holds(self, page: int) -> bool:
        return self.cache.holds(self.base + page)

    def on_unreferenced(self, page: int) -> None:
        self.cache.on_unreferenced(self.base + page)

    def on_referenced(self, page: int) -> None:
        self.cache.on_referenced(self.base + page)

    def evict(self, n: int) -> list[int]:
        return [p - self.base for p in self.cache.evict(n)]


class RankPages:
    """Rank r's pool in global page ids: the allocator one rank's PrefixCache works against."""

    def __init__(self, books: DPPageAllocator, rank: int):
        self.books, self.rank = books, rank
        self.base = rank * books.pages_per_rank
        self._cache: Optional[PrefixCache] = None

    @property
    def cache(self) -> Optional[PrefixCache]:
        return self._cache

    @cache.setter
    def cache(self, cache: PrefixCache) -> None:
        self._cache = cache
        self.books.ranks[self.rank].cache = _LocalKeeper(cache, self.base)

    def allocate(self, n: int) -> list[int] | None:
        return self.books.allocate(n, self.rank)

    def share(self, pages: list[int]) -> None:
        self.books.share(pages)

    def free(self, pages: list[int]) -> None:
        self.books.free(pages)

    def refcount(self, page: int) -> int:
        return self.books.refcount(page)


class CountedJournal:
    """The engine's KV journal behind N ranks' caches: a hash is stored while any rank holds it."""

    def __init__(self, journal):
        self.journal = journal
        self._holders: dict[tuple[str, bytes], int] = {}

    def stored(self, tier: str, h: bytes) -> None:
        key = (tier, h)
        self._holders[key] = self._holders.get(key, 0) + 1
        if self._holders[key] == 1:
            self.journal.stored(tier, h)

    def evicted(self, tier: str, h: bytes) -> None:
        key = (tier, h)
        left = self._holders.get(key, 0) - 1
        if left > 0:
            self._holders[key] = left
            return
        self._holders.pop(key, None)
        self.journal.evicted(tier, h)


class DPPrefixCache:
    """N ranks' prefix caches as one (what the scheduler and the engine ask of a PrefixCache)."""

    in_forward = False  # snapshots are copied from the row after a step (the ranks' forwards write none)
    host = None  # --host-cache-gb is refused with --dp-size (dp_attention.dp_refusal)

    def __init__(
        self,
        books: DPPageAllocator,
        page_size: int,
        snapshots: Optional[list[SnapshotPool]] = None,
        boundary: Optional[int] = None,
    ):
        self.books = books
        self.page_size = page_size
        pools = snapshots or [None] * books.dp_size
        self.ranks = [PrefixCache(RankPages(books, r), page_size, pools[r], boundary) for r in range(books.dp_size)]
        # models with slot states: each rank's snapshots (rank_snapshot_pools), read as one
        self.snapshots = RankSnapshots(snapshots) if snapshots else None
        self.boundary = self.ranks[0].boundary
        self.running: Callable[[], list] = list  # the scheduler's running requests (the engine sets it)
        self.placed = [0] * books.dp_size  # admissions each rank took with a cached prefix
        self._last_rank = 0  # the rank of the last attach: `count` follows it
        self._journal = None
        self._pins = None

    # ---- shared settings --------------------------------------------------------------------

    @property
    def journal(self):
        return self._journal

    @journal.setter
    def journal(self, journal) -> None:
        self._journal = journal
        counted = CountedJournal(journal) if journal is not None else None
        for c in self.ranks:
            c.journal = counted

    @property
    def pins(self):
        return self._pins

    @pins.setter
    def pins(self, pins) -> None:  # one SessionPins over every rank's pages (global ids differ)
        self._pins = pins
        for c in self.ranks:
            c.pins = pins

    @property
    def record_tips(self) -> bool:
        return self.ranks[0].record_tips

    @record_tips.setter
    def record_tips(self, on: bool) -> None:
        for c in self.ranks:
            c.record_tips = on

    # ---- the scheduler's calls --------------------------------------------------------------

    def _rank_of(self, seq: Sequence) -> int:
        if seq.pages:
            return self.books.rank_of(seq.pages[0])
        if seq.cache_node is not None:
            return self.books.rank_of(seq.cache_node.page)
        return 0

    def attach(self, seq: Sequence) -> int:
        """Place the request: the rank `choose_rank` picks from every rank's match and load; it
        takes its cached prefix there (a rank with no match: nothing now, its first pages decide)."""
        matched = [c.match(seq) for c in self.ranks]
        need = -(-seq.num_tokens // self.page_size)
        r = choose_rank(
            matched,
            self.books.free_per_rank(),
            need,
            self.books.running_per_rank(self.running()),
            self.books.rows_free(),
        )
        self._last_rank = r
        if matched[r]:
            self.placed[r] += 1
        slots = self.books.slots
        took = slots is not None and seq.slot is None and matched[r] > 0
        if took:  # its row on that rank, where its cached prefix's snapshot is restored
            seq.slot = slots.allocate_on(r)
            if seq.slot is None:
                return 0  # no row there (choose_rank skips such a rank unless all are full): it waits
        hit = self.ranks[r].attach(seq)
        if took and not seq.pages:  # nothing taken: its first pages place it, and its row follows them
            slots.free(seq.slot)
            seq.slot = None
        return hit

    def count(self, query: int, hit: int) -> None:
        self.ranks[self._last_rank].count(query, hit)

    def insert(self, seq: Sequence) -> None:
        if seq.pages:
            self.ranks[self._rank_of(seq)].insert(seq)

    def forget(self, seq: Sequence) -> None:
        self.ranks[self._rank_of(seq)].forget(seq)

    def snapshot_stop(self, seq: Sequence) -> Optional[int]:
        return self.ranks[self._rank_of(seq)].snapshot_stop(seq)

    def snapshot_points(self, seq: Sequence, n: int) -> list[int]:
        return []  # in_forward is off: a chunk ends at each boundary instead

    def link_snapshots(self, seq: Sequence, taken: list) -> None:
        if taken:
            raise RuntimeError("a data-parallel step wrote snapshots in its forward (none were asked for)")

    def snapshot_due(self, seq: Sequence) -> None:
        if seq.pages:
            self.ranks[self._rank_of(seq)].snapshot_due(seq)

    # ---- what the engine reads --------------------------------------------------------------

    @property
    def num_cached(self) -> int:
        return sum(c.num_cached for c in self.ranks)

    @property
    def num_idle(self) -> int:
        return sum(c.num_idle for c in self.ranks)

    @property
    def query_tokens(self) -> int:
        return sum(c.query_tokens for c in self.ranks)

    @property
    def hit_tokens(self) -> int:
        return sum(c.hit_tokens for c in self.ranks)

    def stats(self) -> dict:
        per_rank = [{"rank": r, **c.stats(), "placed_by_prefix": self.placed[r]} for r, c in enumerate(self.ranks)]
        return {
            "pages_cached": self.num_cached,
            "pages_idle": self.num_idle,
            "query_tokens": self.query_tokens,
            "hit_tokens": self.hit_tokens,
            "ranks": per_rank,
        }

    def bytes_by_state(self, page_bytes: dict[str, int]) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.ranks:
            for name, n in c.bytes_by_state(page_bytes).items():
                out[name] = out.get(name, 0) + n
        return out

    def check(self) -> None:
        for c in self.ranks:
            c.check()
