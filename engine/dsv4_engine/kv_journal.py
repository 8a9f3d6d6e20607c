"""The engine's side of the KV cache events (dsv4_wire.kv_events, the contract): what the caches
hold now, per tier, and the numbered batches of what they gained and lost, for /v1/kv_events.

The caches tell the journal each change as it happens (`stored`, `evicted`, `cleared`: on the
engine thread); a reader (the HTTP process, through the core's channel, on another thread)
takes a `snapshot` (the held sets, and the number of the last batch folded into them) and then
the batches `since` a number. Changes are cut into a batch when someone reads (a burst of a
step's stores is one batch, not one per page), or when too many wait unread. The journal keeps
the last `keep` batches; a reader further behind than that gets None and must take a new
snapshot (the contract's resync). Its first batch, number 1, is `cleared` on every tier: this
process starts with nothing, whatever the router knew of the one before.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Optional

from dsv4_wire import kv_events as wire

MAX_PENDING = 65536  # changes waiting unread before they are cut into a batch anyway


class KVJournal:
    def __init__(self, instance: str, keep: int = 4096, clock=time.time):
        self.instance = instance
        self.keep = keep
        self.clock = clock
        self._lock = threading.Lock()
        self.held: dict[str, set[str]] = {t: set() for t in wire.TIERS}
        self._pending: list[tuple[str, str, Optional[str]]] = []  # (kind, tier, hex hash or None)
        self._batches: deque = deque(maxlen=keep)  # (seq, ts, [wire.Event]), oldest first
        self.seq = 0
        for t in wire.TIERS:
            self._pending.append(("cleared", t, None))
        self._cut()

    # ---- what the caches tell (engine thread) -----------------------------------------------

    def stored(self, tier: str, h: bytes) -> None:
        self._note("stored", tier, h.hex())

    def evicted(self, tier: str, h: bytes) -> None:
        self._note("evicted", tier, h.hex())

    def cleared(self, tier: str) -> None:
        self._note("cleared", tier, None)

    def _note(self, kind: str, tier: str, h: Optional[str]) -> None:
        with self._lock:
            held = self.held[tier]
            if kind == "stored":
                held.add(h)
            elif kind == "evicted":
                held.discard(h)
            else:
                held.clear()
            self._pending.append((kind, tier, h))
            if len(self._pending) >= MAX_PENDING:
                self._cut()

    # ---- what a reader asks (any thread) ----------------------------------------------------

    def snapshot(self) -> dict:
        """What is held now: {"seq": the last batch folded in, "tiers": tier -> [hex hashes]}."""
        with self._lock:
            self._cut()
            return {"seq": self.seq, "tiers": {t: sorted(hs) for t, hs in self.held.items()}}

    def since(self, seq: int) -> Optional[list[dict]]:
        """The batches after `seq`, oldest first, as events messages; None when some of them are
        gone (the reader fell too far behind) or `seq` is ahead of this journal."""
        with self._lock:
            self._cut()
            if seq > self.seq:
                return None
            if seq == self.seq:
                return []
            if not self._batches or self._batches[0][0] > seq + 1:
                return None
            return [wire.events_message(self.instance, s, evs, ts) for s, ts, evs in self._batches if s > seq]

    def _cut(self) -> None:
        """The pending changes as one batch (lock held): consecutive changes of one kind and tier
        become one event, in order (a page stored then evicted stays so)."""
        if not self._pending:
            return
        events: list[wire.Event] = []
        run: list[str] = []
        kind = tier = None
        for k, t, h in self._pending:
            if (k, t) != (kind, tier) or k == "cleared":
                if kind is not None:
                    events.append(wire.Event(kind, tier, tuple(run)))
                kind, tier, run = k, t, []
            if h is not None:
                run.append(h)
        events.append(wire.Event(kind, tier, tuple(run)))
        self._pending = []
        self.seq += 1
        self._batches.append((self.seq, round(self.clock(), 3), events))
