"""The router's subscriptions to the engines' KV cache events: one long-lived GET of
/v1/kv_events per worker (dsv4_wire.kv_events: newline-delimited JSON, snapshot first), each
message folded into the CacheIndex. The I/O shell around the index; its decisions are the
index's (cache_index.py).

- A subscription that must start over (the index asks for a new snapshot: a lost batch, another
  instance; a message the router cannot read; the stream ended or broke) drops what it knew of
  that engine and reconnects, with a back-off (0.25 s doubling to 10 s; reset by a snapshot).
- A stream that says nothing for `stale_after` seconds (engines send a heartbeat every 5 s) is
  cut and reconnected; the index already scores that worker on load alone meanwhile.
- An engine without the endpoint (404/405: an older engine, or another kind) is asked again a
  minute later; its worker is scored on load alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional

import httpx

from dsv4_router.cache_events import CacheSnapshot, Unreadable, from_wire
from dsv4_router.cache_index import RESYNC, CacheIndex
from dsv4_wire import Paths
from dsv4_wire import kv_events as wire

log = logging.getLogger("dsv4.router.cache")

BACKOFF_MIN, BACKOFF_MAX, NO_ENDPOINT_RETRY = 0.25, 10.0, 60.0
TICK_S = 0.5


class CacheSubscriber:
    def __init__(
        self,
        index: CacheIndex,
        headers: Optional[dict] = None,
        stale_after: float = 3 * wire.HEARTBEAT_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.index = index
        self.stale_after = stale_after
        self.clock = clock
        self.client = httpx.AsyncClient(
            headers=headers or {},
            timeout=httpx.Timeout(connect=5.0, read=stale_after, write=5.0, pool=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
        )
        self.tasks: dict[str, asyncio.Task] = {}
        self.status: dict[str, str] = {}  # url -> what its subscription is doing (for /admin/workers)
        self._ticker: Optional[asyncio.Task] = None

    def start(self) -> None:
        if self._ticker is None:
            self._ticker = asyncio.create_task(self._tick())

    def follow(self, url: str) -> None:
        """Keep a subscription to this worker (idempotent)."""
        t = self.tasks.get(url)
        if t is None or t.done():
            self.tasks[url] = asyncio.create_task(self._run(url))

    def drop(self, url: str) -> None:
        t = self.tasks.pop(url, None)
        if t is not None:
            t.cancel()
        self.status.pop(url, None)
        self.index.remove(url)

    def following(self) -> list[str]:
        return list(self.tasks)

    async def aclose(self) -> None:
        tasks = [*self.tasks.values(), *([self._ticker] if self._ticker else [])]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.tasks.clear()
        await self.client.aclose()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            for url in self.index.tick(self.clock()):  # a gap that did not fill: start over
                t = self.tasks.pop(url, None)
                if t is not None:
                    t.cancel()
                self.follow(url)

    async def _run(self, url: str) -> None:
        backoff = BACKOFF_MIN
        while True:
            wait = backoff
            try:
                self.status[url] = "connecting"
                got_snapshot = await self._subscribe(url)
                if got_snapshot:
                    backoff = BACKOFF_MIN
                wait = backoff
                self.status[url] = "resubscribing"
            except NoEndpoint as e:
                self.status[url] = f"no events: {e}"
                wait = NO_ENDPOINT_RETRY
            except (httpx.HTTPError, OSError, ValueError) as e:
                self.status[url] = f"broken: {type(e).__name__}"
            finally:
                self.index.unsubscribed(url)
            await asyncio.sleep(wait)
            backoff = min(BACKOFF_MAX, backoff * 2)

    async def _subscribe(self, url: str) -> bool:
        """One subscription, until it must start over; whether a snapshot came."""
        snapshot = False
        async with self.client.stream("GET", url.rstrip("/") + Paths.KV_EVENTS) as r:
            if r.status_code in (404, 405):
                raise NoEndpoint(f"{Paths.KV_EVENTS} answered {r.status_code}")
            if r.status_code != 200:
                raise httpx.HTTPStatusError(
                    f"{Paths.KV_EVENTS} answered {r.status_code}", request=r.request, response=r
                )
            self.status[url] = "subscribed"
            async for line in r.aiter_lines():
                if not line.strip():
                    continue
                try:
                    msg = from_wire(wire.decode(line))
                except Unreadable as e:
                    log.warning("cache events of %s: %s; subscribing again", url, e)
                    return snapshot
                now = self.clock()
                if isinstance(msg, CacheSnapshot):
                    self.index.snapshot(url, msg, now)
                    snapshot = True
                elif self.index.event(url, msg, now) == RESYNC:
                    return snapshot
        return snapshot


class NoEndpoint(Exception):
    pass
