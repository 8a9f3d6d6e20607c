"""Frozen is not dead: an engine stopped by SIGSTOP (or a frozen container, a hung host) keeps its
sockets open, so nothing fails: its streams just stop, and a client waits forever.

The router watches every request it has sent (a stream it relays, an attempt waiting for its
first event) for a gap far beyond the engine's own pace (`patience`: the longer of
--stall-check-after and STALL_FACTOR times the stream's mean gap so far). A request past its
patience is a suspicion, not a verdict: slow is not frozen (a long prefill, a busy engine). The
suspect engines get a /ready check at once; one that does not answer, or says it is not ready,
is frozen: it leaves the rotation and every request waiting on it moves (migration.STALLED),
as if its connection had broken. One that answers ready is left alone until the next period.

`patience` and `Watched` (the per-request record) are pure; `StallWatch` is the thin loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from dsv4_router.workers import Health, Worker

log = logging.getLogger("dsv4.router")

STALL_FACTOR = 20.0  # gaps this many times the stream's mean gap are far beyond its pace
WATCH_INTERVAL_S = 0.5


def patience(min_s: float, events: int, first_at: float, last_at: float) -> float:
    """Seconds without an event after which a request is suspect. Pure. `events` events seen
    between `first_at` and `last_at` give the stream's pace; before two, only the floor."""
    if events < 2:
        return min_s
    pace = (last_at - first_at) / (events - 1)
    return max(min_s, STALL_FACTOR * pace)


@dataclass(eq=False)
class Watched:
    """One request on its way at `workers` (the decode, and its prefill while that leg runs)."""

    workers: tuple[Worker, ...]
    on_frozen: Callable[[Worker], None]  # stops the wait; the request moves
    started_at: float = field(default_factory=time.monotonic)
    events: int = 0
    first_at: float = 0.0
    last_at: float = 0.0
    checked_at: float = 0.0  # the last check of its workers it asked for
    frozen: Optional[Worker] = None

    def event(self, now: float) -> None:
        """The engine sent something: progress."""
        if self.events == 0:
            self.first_at = now
        self.events += 1
        self.last_at = now

    def suspect(self, now: float, min_s: float) -> bool:
        """Silent past its patience, and not checked within it already. Pure."""
        wait = patience(min_s, self.events, self.first_at, self.last_at)
        since = max(self.last_at if self.events else self.started_at, self.checked_at)
        return now - since > wait


class StallWatch:
    """Every watched request, checked every WATCH_INTERVAL_S; `min_s` 0 turns it off."""

    def __init__(self, health: Health, min_s: float) -> None:
        self.health, self.min_s = health, min_s
        self.watched: set[Watched] = set()

    def watch(self, workers: tuple[Worker, ...], on_frozen: Callable[[Worker], None]) -> Watched:
        w = Watched(workers, on_frozen)
        if self.min_s > 0:
            self.watched.add(w)
        return w

    def unwatch(self, w: Watched) -> None:
        self.watched.discard(w)

    async def loop(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            try:
                await self.round(time.monotonic())
            except Exception:
                log.exception("stall watch round failed")

    async def round(self, now: float) -> None:
        suspects = [w for w in list(self.watched) if w.frozen is None and w.suspect(now, self.min_s)]
        if not suspects:
            return
        workers = {wk.url: wk for s in suspects for wk in s.workers}
        verdicts = dict(zip(workers, await asyncio.gather(*(self.health.frozen(wk) for wk in workers.values()))))
        for s in suspects:
            s.checked_at = time.monotonic()
            for wk in s.workers:
                if verdicts.get(wk.url) and s in self.watched:
                    silent = now - (s.last_at if s.events else s.started_at)
                    log.warning(
                        "%s is frozen (%s) while a request waited %.1fs on it: moving it", wk.url, wk.reason, silent
                    )
                    s.frozen = wk
                    self.unwatch(s)
                    s.on_frozen(wk)
                    break
