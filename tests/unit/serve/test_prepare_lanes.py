"""An engine's HTTP process prepares long prompts in their own bounded lane
(dsv4_serve.prepare_lanes): a short request is never queued behind them, and past the bound a
long one is refused at once with a 429 (the fault matrix's tokenizer_overload cell is the
HTTP-level check)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from dsv4_serve.prepare_lanes import HEAVY_BYTES, HEAVY_WORKERS, PrepareLanes, heavy_refusal, is_heavy
from dsv4_wire import APIError


def test_lane_by_body_size():
    assert not is_heavy(200)
    assert not is_heavy(HEAVY_BYTES - 1)
    assert is_heavy(HEAVY_BYTES)


def test_heavy_refusal_is_a_429_past_the_bound_only():
    assert heavy_refusal(5, None) is None
    assert heavy_refusal(3, 4) is None
    e = heavy_refusal(4, 4)
    assert e is not None and e.status == 429 and e.body()["error"]["type"] == "rate_limit_error"


def test_a_short_request_passes_every_long_one_and_a_long_one_past_the_bound_gets_429():
    release = threading.Event()

    def slow(x):  # a long prompt being tokenized
        release.wait(10)
        return x

    async def go():
        lanes = PrepareLanes(heavy_bound=HEAVY_WORKERS + 2)
        try:
            heavy = [asyncio.ensure_future(lanes.run(HEAVY_BYTES, slow, i)) for i in range(HEAVY_WORKERS + 2)]
            await asyncio.sleep(0.05)
            assert lanes.heavy_waiting == HEAVY_WORKERS + 2
            # every heavy thread is busy and two more wait: a short body still goes at once
            assert await asyncio.wait_for(lanes.run(100, lambda: "short"), 2) == "short"
            with pytest.raises(APIError) as refused:
                await lanes.run(HEAVY_BYTES, slow, 99)
            assert refused.value.status == 429
            release.set()
            assert await asyncio.gather(*heavy) == list(range(HEAVY_WORKERS + 2))
            assert lanes.heavy_waiting == 0
        finally:
            release.set()
            lanes.close()

    asyncio.run(go())
