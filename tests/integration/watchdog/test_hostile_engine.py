"""One tenant's engine cannot stall the shared operator (issue 27, item 1).

A DSV4Deployment names any image, so its engine's /metrics, /v1/loads, /debug/stacks and its
pod log are tenant output. The hostile engine here serves, in rotation: a label set that never
closes (which made the old metrics regular expression backtrack for ~10 s per line), an 8 MiB
line, an endless stream, a megabyte of unclosed label sets (the reference parser's slow path),
JSON nested deeper than Python's stack, an endless /debug/stacks and a 20 MiB pod log. Meanwhile
another deployment's pod wedges: it must be remediated as fast as without the hostile engine,
and the operator's /healthz must keep answering.
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional

import aiohttp
import aiohttp.web
import httpx

from bench.harness.kmock_cluster import ClusterClient, eventually
from test_watchdog_operator import DETECT, start_deployment, watching
from watchdog_harness import NS, PLURAL, ScriptedEngine, WatchdogCluster, deployment

BOMB = "dsv4:kv_transfers_completed_total{" + 'x="y" ' * 11 + " # 1\n"  # ~10 s per line for the old regex
HUGE = "dsv4:num_running_reqs " + "9" * (8 << 20) + "\n"
UNCLOSED = 'dsv4:num_queue_reqs{role="p" 3 # {a="b"} 1\n' * (1 << 20 >> 5)
DEEP_JSON = "[" * 200_000


class HostileEngine(ScriptedEngine):
    """A tenant engine whose every body is built to hurt the reader."""

    async def _metrics(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        self.scrapes += 1
        kind = (self.scrapes - 1) % 4  # the first body is the one that used to stall the operator
        if kind == 0:
            return aiohttp.web.Response(text=self.metrics() + BOMB * 20)
        if kind == 1:
            return aiohttp.web.Response(text=HUGE)
        if kind == 2:
            return await _endless(request, b"dsv4:num_running_reqs{" + b'a="b",' * 40_000)
        return aiohttp.web.Response(text=UNCLOSED)

    async def _loads(self, _: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.Response(text=DEEP_JSON, content_type="application/json")

    async def _admin(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        self.calls.append((time.monotonic(), request.method, request.path))
        if request.path == "/debug/stacks":
            return await _endless(request, b"--- thread ---\n" * 16_000)
        return aiohttp.web.json_response({"ok": True})


async def _endless(request: aiohttp.web.Request, chunk: bytes) -> aiohttp.web.StreamResponse:
    resp = aiohttp.web.StreamResponse()
    await resp.prepare(request)
    try:
        while True:  # until the reader hangs up; ~50 MB/s so a reader without a cap still ends
            await resp.write(chunk)
            await asyncio.sleep(0.005)
    except (ConnectionError, RuntimeError):
        pass
    return resp


async def _remediation_delay(
    kube_cluster: WatchdogCluster, kube_client: ClusterClient, pod_farm, engines, operator_factory, hostile: bool
) -> tuple[float, float]:
    """(seconds from the wedge to the wedged pod's deletion, worst /healthz latency meanwhile)."""
    op = await operator_factory()
    if hostile:
        tenant = pod_farm("tenant")
        tenant.recreate_after = 0.5
        tenant.own_statefulsets = True  # its pod comes before its resource
        bad = await HostileEngine("prefill").start()
        try:
            await tenant.add("tenant-prefill-0", "prefill", bad.port)
            kube_cluster.pod_logs[(NS, "tenant-prefill-0")] = lambda: "x" * (20 << 20)
            await kube_client.create(deployment("tenant", remediation={}), PLURAL)
            timing = await _wedge_and_time(kube_cluster, kube_client, pod_farm, engines, op.health_port)
            print(f"\nhostile engine: {bad.scrapes} scrapes, calls {bad.admin_calls()}")
            assert bad.scrapes >= 4, "every hostile body was served"
            return timing
        finally:
            await bad.stop()
    return await _wedge_and_time(kube_cluster, kube_client, pod_farm, engines, op.health_port)


async def _wedge_and_time(kube_cluster, kube_client, pod_farm, engines, health_port: int) -> tuple[float, float]:
    farm = pod_farm("flash")
    _, backends = await start_deployment(
        kube_client, farm, engines, "flash", {"flash-prefill-0": "healthy", "flash-decode-0": "healthy"}
    )
    await eventually(lambda: watching(kube_client, "flash", 2), timeout=15)
    worst = 0.0
    stop = asyncio.Event()

    async def probe() -> None:
        nonlocal worst
        async with httpx.AsyncClient(timeout=30) as http:
            while not stop.is_set():
                t = time.monotonic()
                r = await http.get(f"http://127.0.0.1:{health_port}/healthz")
                assert r.status_code == 200, r.text
                worst = max(worst, time.monotonic() - t)
                await asyncio.sleep(0.1)

    prober = asyncio.create_task(probe())
    backends["flash-prefill-0"].set_mode("wedged")
    wedged_at = time.monotonic()
    deleted: Optional[float] = None
    try:

        async def gone() -> Optional[float]:
            for when, what, pod in farm.timeline:
                if (what, pod) == ("deleted", "flash-prefill-0"):
                    return when
            return None

        deleted = await eventually(gone, timeout=DETECT)
    finally:
        stop.set()
        await prober
    return deleted - wedged_at, worst


async def test_a_wedge_is_remediated_without_a_hostile_engine(
    kube_cluster: WatchdogCluster, kube_client: ClusterClient, pod_farm, engines, operator_factory
) -> None:
    delay, worst = await _remediation_delay(kube_cluster, kube_client, pod_farm, engines, operator_factory, False)
    print(f"\nremediation delay without a hostile engine: {delay:.2f}s, worst /healthz {worst * 1000:.0f} ms")
    assert delay < DETECT and worst < 3.0


async def test_a_hostile_engine_neither_stalls_the_operator_nor_delays_another_remediation(
    kube_cluster: WatchdogCluster, kube_client: ClusterClient, pod_farm, engines, operator_factory
) -> None:
    delay, worst = await _remediation_delay(kube_cluster, kube_client, pod_farm, engines, operator_factory, True)
    print(f"\nremediation delay with a hostile engine: {delay:.2f}s, worst /healthz {worst * 1000:.0f} ms")
    assert delay < DETECT and worst < 3.0
