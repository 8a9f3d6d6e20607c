"""Where an engine's HTTP process turns a request body into token ids (render, tokenize,
validate): two lanes, so a flood of long prompts never starves short ones.

Before, every request's preparation queued FIFO on asyncio's one default thread pool: 48 chat
requests of ~37 KB each took ~10 s of tokenizer time, and a 4-token completion arriving behind
them waited ~3 s for its first token while the core sat idle (SGLang #33858's overload, found by
the fault matrix's tokenizer_overload cell). Now bodies of at least `heavy_bytes` go to a lane
of `heavy_workers` threads and the rest to their own lane; the heavy lane's queue is bounded
(the engine's --max-queued-requests when set): past it a request is refused at once with a 429
and Retry-After, never held without bound.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, TypeVar

from dsv4_wire import APIError

T = TypeVar("T")

HEAVY_BYTES = 16 * 1024  # a body this large is a long prompt (a 4-token completion is ~200 B)
HEAVY_WORKERS = 2  # tokenizing is CPU work: more threads than this only share the same cores
LIGHT_WORKERS = 4


def is_heavy(body_bytes: int, heavy_bytes: int = HEAVY_BYTES) -> bool:
    """Pure: does a body of this size go to the heavy lane?"""
    return body_bytes >= heavy_bytes


def heavy_refusal(waiting: int, bound: Optional[int]) -> Optional[APIError]:
    """Pure: the 429 for one more heavy request when `waiting` are already queued for the
    heavy lane, else None (no bound: never refused here)."""
    if bound is None or waiting < bound:
        return None
    return APIError(
        f"too many long prompts waiting to be tokenized ({waiting}); retry later",
        429,
        "rate_limit_error",
        code="tokenizer_queue_full",
    )


class PrepareLanes:
    def __init__(self, heavy_bound: Optional[int] = None, heavy_bytes: int = HEAVY_BYTES):
        self.heavy_bytes, self.heavy_bound = heavy_bytes, heavy_bound
        self._light = ThreadPoolExecutor(LIGHT_WORKERS, thread_name_prefix="prepare")
        self._heavy = ThreadPoolExecutor(HEAVY_WORKERS, thread_name_prefix="prepare-long")
        self.heavy_waiting = 0  # heavy requests queued or being prepared

    async def run(self, body_bytes: int, fn: Callable[..., T], *args) -> T:
        loop = asyncio.get_running_loop()
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        if not is_heavy(body_bytes, self.heavy_bytes):
            return await loop.run_in_executor(self._light, call)
        refusal = heavy_refusal(self.heavy_waiting, self.heavy_bound)
        if refusal is not None:
            raise refusal
        self.heavy_waiting += 1
        try:
            return await loop.run_in_executor(self._heavy, call)
        finally:
            self.heavy_waiting -= 1

    def close(self) -> None:
        self._light.shutdown(wait=False, cancel_futures=True)
        self._heavy.shutdown(wait=False, cancel_futures=True)
