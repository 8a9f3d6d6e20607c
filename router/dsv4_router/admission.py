"""Admission control: at most `max_inflight` requests inside the router, a bounded FIFO queue in
front of them, and a refusal (429 with Retry-After) beyond that -- back-pressure the client can
act on, instead of connections piling up until something times out.

The decision is a pure function; `Admission` is the asyncio shell that applies it. A queued
request is handed its slot directly by the one that releases it (FIFO, no thundering herd).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Literal

Decision = Literal["admit", "queue", "reject"]


def decide(inflight: int, max_inflight: int, queued: int, max_queue: int) -> Decision:
    """What to do with a new request. Waiting requests go first, so a newcomer never overtakes
    the queue even when a slot happens to be free at this instant."""
    if inflight < max_inflight and queued == 0:
        return "admit"
    if queued < max_queue:
        return "queue"
    return "reject"


class Overloaded(Exception):
    def __init__(self, reason: str, retry_after: int):
        super().__init__(reason)
        self.reason, self.retry_after = reason, retry_after


class Admission:
    def __init__(self, max_inflight: int, max_queue: int, queue_timeout: float):
        if max_inflight < 1 or max_queue < 0 or queue_timeout <= 0:
            raise ValueError("need max_inflight >= 1, max_queue >= 0, queue_timeout > 0")
        self.max_inflight, self.max_queue, self.queue_timeout = max_inflight, max_queue, queue_timeout
        self.inflight = 0
        self._waiters: deque[asyncio.Future] = deque()
        self.rejected = 0

    @property
    def queued(self) -> int:
        return len(self._waiters)

    @property
    def retry_after(self) -> int:
        """Seconds a refused client should wait: long enough for a queue's worth to move on."""
        return max(1, min(30, round(self.queue_timeout / 4)))

    async def acquire(self) -> None:
        """Take a slot, waiting in the queue up to queue_timeout; Overloaded otherwise."""
        what = decide(self.inflight, self.max_inflight, self.queued, self.max_queue)
        if what == "admit":
            self.inflight += 1
            return
        if what == "reject":
            self.rejected += 1
            raise Overloaded(
                f"the router is at its limit of {self.max_inflight} requests in flight "
                f"and {self.max_queue} waiting; retry later",
                self.retry_after,
            )
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait({fut}, timeout=self.queue_timeout)
        except asyncio.CancelledError:  # the client left while queued
            if fut.done() and not fut.cancelled():
                self.release()  # a slot was handed over just now: pass it on
            else:
                fut.cancel()
                self._forget(fut)
            raise
        if fut.done() and not fut.cancelled():
            return  # release() handed us its slot; inflight already counts it
        fut.cancel()
        self._forget(fut)
        self.rejected += 1
        raise Overloaded(
            f"waited {self.queue_timeout:g}s for one of the router's {self.max_inflight} request slots; retry later",
            self.retry_after,
        )

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot moves to the oldest waiter
                return
        self.inflight -= 1

    def _forget(self, fut: asyncio.Future) -> None:
        try:
            self._waiters.remove(fut)
        except ValueError:
            pass


class Slot:
    """One request's hold on an admission slot; release() is idempotent, so whichever of the
    handler or the streaming response finishes last can call it safely."""

    def __init__(self, admission: Admission):
        self.admission = admission
        self.held = False

    async def acquire(self) -> None:
        await self.admission.acquire()
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.admission.release()
