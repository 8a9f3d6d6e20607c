"""The router's index of the fleet's caches: per worker, the page hashes it holds, per tier,
kept from each engine's cache events (dsv4_wire.kv_events, read through cache_events.py). No I/O:
the subscription client (cache_subscriber.py) feeds it snapshots, event batches and heartbeats;
the placement asks it what each worker holds of a prompt.

Trust rules (a claim the index cannot vouch for is never used; the worker is then scored on
load alone, see scoring.py):
- A worker is *synced* once a snapshot of its current instance is applied and no batch has been
  lost since. Batches are applied in `seq` order: a duplicate or an old one is dropped; one past
  a gap waits (up to `reorder_window` of them, for at most `gap_timeout` seconds) for the gap to
  fill; a heartbeat naming a later `seq` than applied opens a gap too. While a gap is open the
  worker is not fresh. A gap that does not fill is a lost batch: the worker's pages are dropped
  and it needs a new snapshot (`RESYNC` answers say so).
- An event or snapshot under a new instance id is a restarted or replaced engine: everything
  known of the old one is dropped first. A `cleared` event drops a tier (or all of them).
- A worker whose stream has said nothing (not even a heartbeat) for `stale_after` seconds is not
  fresh.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from dsv4_router.cache_events import TIERS, CacheEvents, CacheSnapshot, Heartbeat
from dsv4_router.scoring import NO_MATCH, Match

BIT = {t: 1 << i for i, t in enumerate(TIERS)}
RESYNC = "resync"  # the answer that asks the caller for a new snapshot of that worker


@dataclass
class WorkerCache:
    instance: Optional[str] = None
    seq: int = -1  # the last batch applied (or included in the snapshot)
    expect: int = -1  # the last batch the stream said it sent (a heartbeat's seq)
    synced: bool = False
    pages: dict = field(default_factory=lambda: {t: set() for t in TIERS})
    pending: dict = field(default_factory=dict)  # seq -> event, past a gap (or before the snapshot)
    gap_since: Optional[float] = None
    last_heard: Optional[float] = None  # when the stream last said anything
    lost: int = 0  # times events were lost (a resync followed)
    restarts: int = 0  # new instances seen
    page_size: int = 0  # the engine's page geometry, from its snapshot: how to hash a prompt for it
    boundary_tokens: int = 0


class CacheIndex:
    def __init__(self, stale_after: float = 10.0, reorder_window: int = 256, gap_timeout: float = 2.0):
        self.stale_after = stale_after
        self.reorder_window = reorder_window
        self.gap_timeout = gap_timeout
        self.workers: dict[str, WorkerCache] = {}
        # page hash -> {worker: tier bits}: one walk of a prompt's chain finds every holder
        self.holders: dict[object, dict[str, int]] = {}

    # ---- feeding -------------------------------------------------------------------------------

    def _state(self, worker: str) -> WorkerCache:
        w = self.workers.get(worker)
        if w is None:
            w = self.workers[worker] = WorkerCache()
        return w

    def snapshot(self, worker: str, snap: CacheSnapshot, now: float) -> None:
        """A subscription's first message: what the worker holds, as of event `snap.seq`."""
        w = self._state(worker)
        if w.instance is not None and w.instance != snap.instance:
            w.restarts += 1
        self._drop(worker, w, TIERS)
        w.instance, w.seq, w.synced, w.last_heard, w.gap_since = snap.instance, snap.seq, True, now, None
        w.expect = snap.seq
        w.page_size, w.boundary_tokens = snap.page_size, snap.boundary_tokens
        for tier, hashes in snap.pages.items():
            if tier not in BIT:
                raise ValueError(f"unknown cache tier {tier!r}")
            self._store(worker, w, tier, hashes)
        pending, w.pending = w.pending, {}
        for seq in sorted(pending):
            ev = pending[seq]
            if ev.instance == snap.instance and seq > snap.seq:
                self.event(worker, ev, now)

    def event(self, worker: str, ev: "CacheEvents | Heartbeat", now: float) -> Optional[str]:
        """One batch (or heartbeat) of the worker's stream; RESYNC when a new snapshot is needed."""
        w = self._state(worker)
        w.last_heard = now
        if isinstance(ev, Heartbeat):
            if ev.instance != w.instance and w.instance is not None:
                return self.event(worker, CacheEvents(ev.instance, ev.seq), now)  # a new engine: same as a batch
            if w.synced and ev.seq > w.seq:
                w.expect = max(w.expect, ev.seq)  # batches up to ev.seq were sent and are not here (yet)
                w.gap_since = w.gap_since or now
            return None
        if ev.instance != w.instance:
            # a restarted or replaced engine: nothing of the old one holds
            if w.instance is not None:
                w.restarts += 1
            self._drop(worker, w, TIERS)
            w.instance, w.seq, w.expect, w.synced, w.gap_since = ev.instance, -1, -1, False, None
            w.pending = {ev.seq: ev}
            return RESYNC
        if not w.synced:  # waiting for the snapshot: keep what comes meanwhile (bounded)
            if len(w.pending) < self.reorder_window:
                w.pending[ev.seq] = ev
            return None
        if ev.seq <= w.seq:
            return None  # a duplicate, or older than what is applied
        if ev.seq > w.seq + 1:
            w.pending[ev.seq] = ev
            if w.gap_since is None:
                w.gap_since = now
            if len(w.pending) > self.reorder_window:
                return self._lose(worker, w)
            return None
        self._apply(worker, w, ev)
        while w.seq + 1 in w.pending:
            self._apply(worker, w, w.pending.pop(w.seq + 1))
        w.pending = {s: e for s, e in w.pending.items() if s > w.seq}
        w.gap_since = (w.gap_since or now) if w.pending or w.seq < w.expect else None
        return None

    def tick(self, now: float) -> list[str]:
        """Workers whose gap did not fill in time: their pages are dropped; they need a snapshot."""
        out = []
        for worker, w in self.workers.items():
            if w.synced and w.gap_since is not None and now - w.gap_since > self.gap_timeout:
                self._lose(worker, w)
                out.append(worker)
        return out

    def remove(self, worker: str) -> None:
        w = self.workers.pop(worker, None)
        if w is not None:
            self._drop(worker, w, TIERS)

    def unsubscribed(self, worker: str) -> None:
        """The worker's stream ended: nothing it said can be kept current; a new subscription
        starts with a snapshot."""
        w = self.workers.get(worker)
        if w is not None:
            self._drop(worker, w, TIERS)
            w.synced, w.pending, w.gap_since = False, {}, None

    # ---- asking --------------------------------------------------------------------------------

    def fresh(self, worker: str, now: float) -> bool:
        w = self.workers.get(worker)
        return (
            w is not None
            and w.synced
            and w.gap_since is None
            and w.last_heard is not None
            and now - w.last_heard <= self.stale_after
        )

    def match(self, chain: Sequence, workers: Iterable[str], now: float) -> dict[str, Match]:
        """What each (fresh) worker holds of a prompt's page chain: the longest prefix, by tier.
        One walk of the chain for all workers; a stale worker gets NO_MATCH."""
        active = {u: [0, 0, 0] for u in workers if self.fresh(u, now)}
        out: dict[str, Match] = {}
        for h in chain:
            if not active:
                break
            held = self.holders.get(h)
            if not held:
                break
            for u in list(active):
                bits = held.get(u, 0)
                if not bits:
                    out[u] = Match(*active.pop(u))
                    continue
                counts = active[u]
                counts[0 if bits & 1 else 1 if bits & 2 else 2] += 1
        for u, counts in active.items():
            out[u] = Match(*counts)
        return {u: out.get(u, NO_MATCH) for u in workers}

    def view(self, worker: str, now: float) -> dict:
        """For /admin/workers: pages per tier, the age of the last event, whether it is trusted."""
        w = self.workers.get(worker)
        if w is None:
            return {"subscribed": False, "fresh": False}
        return {
            "subscribed": True,
            "instance": w.instance,
            "seq": w.seq,
            "synced": w.synced,
            "fresh": self.fresh(worker, now),
            "pages": {t: len(w.pages[t]) for t in TIERS},
            "page_size": w.page_size,
            "boundary_tokens": w.boundary_tokens,
            "last_event_age_s": None if w.last_heard is None else round(now - w.last_heard, 3),
            "events_lost": w.lost,
            "restarts": w.restarts,
        }

    # ---- internals -----------------------------------------------------------------------------

    def _lose(self, worker: str, w: WorkerCache) -> str:
        self._drop(worker, w, TIERS)
        w.synced, w.pending, w.gap_since = False, {}, None
        w.lost += 1
        return RESYNC

    def _apply(self, worker: str, w: WorkerCache, ev: CacheEvents) -> None:
        w.seq = ev.seq
        for c in ev.changes:
            if c.tier not in BIT:
                raise ValueError(f"unknown cache tier {c.tier!r}")
            if c.kind == "stored":
                self._store(worker, w, c.tier, c.hashes)
            elif c.kind == "evicted":
                self._evict(worker, w, c.tier, c.hashes)
            elif c.kind == "cleared":
                self._drop(worker, w, (c.tier,))

    def _store(self, worker: str, w: WorkerCache, tier: str, hashes: Iterable) -> None:
        bit, pages, holders = BIT[tier], w.pages[tier], self.holders
        for h in hashes:
            if h in pages:
                continue
            pages.add(h)
            held = holders.get(h)
            if held is None:
                holders[h] = {worker: bit}
            else:
                held[worker] = held.get(worker, 0) | bit

    def _evict(self, worker: str, w: WorkerCache, tier: str, hashes: Iterable) -> None:
        bit, pages, holders = BIT[tier], w.pages[tier], self.holders
        for h in hashes:
            if h not in pages:
                continue
            pages.discard(h)
            held = holders[h]
            left = held[worker] & ~bit
            if left:
                held[worker] = left
            else:
                del held[worker]
                if not held:
                    del holders[h]

    def _drop(self, worker: str, w: WorkerCache, tiers: Iterable[str]) -> None:
        for tier in tiers:
            pages = w.pages[tier]
            self._evict(worker, w, tier, list(pages))
