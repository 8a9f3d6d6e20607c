"""`dsv4 up`'s watch on its router (operator/dsv4_operator/local/router_watch.py): a real router
process, frozen with SIGSTOP, is reported Wedged (unresponsive) once the window has passed, with
its evidence, and once only; a router that answers is Healthy."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from bench.harness.commands import Proc, free_port
from dsv4_operator.local.router_watch import RouterWatch
from watchdog_harness import wait_metrics


@pytest.mark.slow  # ~7 s: each scrape of the frozen router waits out its 2 s timeout
def test_a_frozen_router_is_reported_once_with_evidence(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    router = Proc(["router", "--mono", "http://127.0.0.1:9", "--port", port], tmp_path / "router.log")
    try:
        wait_metrics(url, router)

        async def watch() -> list:
            said = []
            w = RouterWatch(window_s=2.0)
            async with httpx.AsyncClient() as client:
                assert await w.round(client, url, "1") is None and w.verdict["state"] == "Healthy"
                os.kill(router.popen.pid, signal.SIGSTOP)
                end, rounds_after = time.monotonic() + 12, 0
                while time.monotonic() < end and rounds_after < 2:  # two more rounds: said once only
                    got = await w.round(client, url, "1")
                    if got is not None:
                        said.append(got)
                    rounds_after += bool(said)
                    await asyncio.sleep(0.2)
            return said

        said = asyncio.run(watch())
        assert len(said) == 1, said
        assert said[0]["state"] == "Wedged" and said[0]["reason"] == "unresponsive", said
        assert said[0]["details"]["silent_seconds"] >= 2.0
    finally:
        try:
            os.kill(router.popen.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        router.stop()
