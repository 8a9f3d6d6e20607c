"""The scrape shell against real HTTP servers on 127.0.0.1 serving the engine contract's formats."""

import asyncio
import json
import socket
import time

import httpx
import pytest
from aiohttp import web

from dsv4_operator.watchdog.signals import ScrapeTarget
from dsv4_operator.remediation.scrape import make_session, scrape_all, scrape_engine
from dsv4_operator.watchdog.signals import BUILTIN, SGLANG

METRICS = """\
# TYPE dsv4:num_prefill_inflight_queue_reqs gauge
dsv4:num_prefill_inflight_queue_reqs{role="prefill",model_name="tiny"} 9
# TYPE dsv4:kv_transfers_completed counter
dsv4:kv_transfers_completed_total{role="prefill",model_name="tiny"} 41
"""
LOADS = {"role": "prefill", "queues": {"inflight": 2, "waiting": 1}, "prefill_inflight_oldest_age_seconds": 3.5}


class EngineEndpoints:
    """An HTTP server with /metrics and /v1/loads; knobs to slow or break either."""

    def __init__(self):
        self.requests: list[str] = []
        self.delay = 0.0
        self.metrics_status = 200
        self.loads_body = json.dumps(LOADS)
        self.inflight = 0
        self.max_inflight = 0

    async def _enter(self, request):
        self.requests.append(str(request.rel_url))
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
        finally:
            self.inflight -= 1

    async def metrics(self, request):
        await self._enter(request)
        return web.Response(text=METRICS, status=self.metrics_status)

    async def loads(self, request):
        await self._enter(request)
        return web.Response(text=self.loads_body, content_type="application/json")

    async def start(self):
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/loads", self.loads)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = "http://127.0.0.1:%d" % self.runner.addresses[0][1]
        return self


@pytest.fixture
async def engine():
    e = await EngineEndpoints().start()
    yield e
    await e.runner.cleanup()


def closed_port_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def test_scrape_engine_merges_both_endpoints(engine):
    async with make_session() as client:
        s = await scrape_engine(client, engine.url, "prefill", BUILTIN, clock=lambda: 42.0)
    assert s.reachable and s.error is None and s.timestamp == 42.0
    assert s.prefill_inflight == 2  # live /v1/loads wins over the gauge
    assert s.prefill_inflight_oldest_age_seconds == 3.5
    assert s.transfers_completed == 41
    assert sorted(engine.requests) == ["/metrics", "/v1/loads"]


async def test_sglang_asks_for_disagg_section(engine):
    engine.loads_body = json.dumps(
        {
            "loads": [
                {
                    "dp_rank": 0,
                    "num_running_reqs": 0,
                    "disaggregation": {"mode": "prefill", "prefill_inflight_queue_reqs": 1},
                }
            ]
        }
    )
    async with make_session() as client:
        s = await scrape_engine(client, engine.url + "/", "prefill", SGLANG)
    assert "/v1/loads?include=disagg" in engine.requests
    assert s.prefill_inflight == 1


async def test_one_endpoint_failing_is_still_reachable(engine):
    engine.metrics_status = 500
    async with make_session() as client:
        s = await scrape_engine(client, engine.url, "prefill")
    assert s.reachable and s.prefill_inflight == 2 and s.transfers_completed is None
    assert "HTTP 500" in s.error


async def test_bad_json_loads_falls_back_to_metrics(engine):
    engine.loads_body = "{not json"
    async with make_session() as client:
        s = await scrape_engine(client, engine.url, "prefill")
    assert s.reachable and s.prefill_inflight == 9 and "invalid JSON" in s.error


async def test_nothing_listening_is_unreachable():
    url = closed_port_url()
    async with make_session() as client:
        s = await scrape_engine(client, url, "decode")
    assert not s.reachable and s.role == "decode"
    assert s.error.startswith(url + "/metrics: ClientConnectorError")


async def test_slow_engine_times_out(engine):
    engine.delay = 1.0
    async with make_session() as client:
        t0 = time.monotonic()
        s = await scrape_engine(client, engine.url, "prefill", timeout=0.2)
        elapsed = time.monotonic() - t0
    assert not s.reachable and "Timeout" in s.error
    assert elapsed < 0.8  # both requests ran concurrently and were cut at the timeout


async def test_scrape_all_bounded_concurrency(engine):
    engine.delay = 0.05
    targets = [ScrapeTarget(f"pod-{i}", engine.url, "prefill") for i in range(12)]
    targets.append(ScrapeTarget("dead", closed_port_url(), "decode"))
    async with make_session(concurrency=3) as client:
        samples = await scrape_all(targets, concurrency=3, timeout=2.0, client=client)
        # A second round reuses the kept-alive connections.
        again = await scrape_all(targets[:12], concurrency=3, timeout=2.0, client=client)
    assert set(samples) == {t.key for t in targets}
    assert all(samples[f"pod-{i}"].reachable for i in range(12))
    assert not samples["dead"].reachable
    # 3 engines at a time, 2 requests each.
    assert engine.max_inflight <= 6
    assert len(engine.requests) == 48
    assert all(s.reachable for s in again.values())


async def test_scrape_all_makes_and_closes_its_own_client(engine):
    samples = await scrape_all([ScrapeTarget("a", engine.url, "prefill")])
    assert samples["a"].reachable


async def test_an_httpx_client_works_too(engine):
    async with httpx.AsyncClient() as client:
        s = await scrape_engine(client, engine.url, "prefill")
        dead = await scrape_engine(client, closed_port_url(), "prefill")
    assert s.reachable and s.prefill_inflight == 2 and s.transfers_completed == 41
    assert not dead.reachable and "ConnectError" in dead.error
