"""The wedge watchdog against fake SGLang engines (real HTTP on 127.0.0.1) speaking the
exposition of two builds: older releases export `sglang:kv_transfer_latency_ms` as a gauge (no
completion counter), newer ones as a histogram (`_count` counts completed transfers). The
incident's prefill (one request in the inflight queue for many minutes, transfer failures at 10,
nothing else moving) must be judged wedged on both, by signals every build exposes, and the
verdict must name them; an idle older build whose gauges are stale must never be.
Issue 32, item 6. Time is simulated: the scrapes are real, their timestamps are given."""

from __future__ import annotations

import json
from typing import Optional

import aiohttp
import pytest
from aiohttp import web

from dsv4_operator.watchdog.policy import Action
from dsv4_operator.watchdog.report import wedge_message
from dsv4_operator.watchdog.detector import Detector, Wedged
from dsv4_operator.remediation.scrape import make_session, scrape_engine
from dsv4_operator.watchdog.signals import SGLANG

LABELS = 'model_name="dsv4",engine_type="unified",tp_rank="0"'


class FakeSGLang:
    """A prefill engine's /metrics and /v1/loads as one SGLang build writes them."""

    def __init__(self, build: str, loads: bool = True) -> None:
        self.build, self.serves_loads = build, loads
        self.inflight = 0  # live
        self.inflight_gauge = 0  # as last logged with a batch (stale when idle)
        self.transfers = 0
        self.requests = 0
        self.failed = 10
        self.runner: Optional[web.AppRunner] = None
        self.url = ""

    def metrics(self) -> str:
        lines = [
            "# TYPE sglang:num_prefill_inflight_queue_reqs gauge",
            f"sglang:num_prefill_inflight_queue_reqs{{{LABELS}}} {self.inflight_gauge}",
            "# TYPE sglang:num_transfer_failed_reqs_total counter",
            f"sglang:num_transfer_failed_reqs_total{{{LABELS}}} {self.failed}",
            "# TYPE sglang:num_bootstrap_failed_reqs_total counter",
            f"sglang:num_bootstrap_failed_reqs_total{{{LABELS}}} 1",
            "# TYPE sglang:num_requests_total counter",
            f"sglang:num_requests_total{{{LABELS}}} {self.requests}",
            "# TYPE sglang:prompt_tokens_total counter",
            f"sglang:prompt_tokens_total{{{LABELS}}} {self.requests * 100}",
        ]
        if self.build == "histogram":
            lines += [
                "# TYPE sglang:kv_transfer_latency_ms histogram",
                f'sglang:kv_transfer_latency_ms_bucket{{le="100.0",{LABELS}}} {self.transfers}',
                f'sglang:kv_transfer_latency_ms_bucket{{le="+Inf",{LABELS}}} {self.transfers}',
                f"sglang:kv_transfer_latency_ms_sum{{{LABELS}}} {self.transfers * 12.5}",
                f"sglang:kv_transfer_latency_ms_count{{{LABELS}}} {self.transfers}",
            ]
        else:  # the older gauge: the last transfer's latency, nothing to count with
            lines += ["# TYPE sglang:kv_transfer_latency_ms gauge", f"sglang:kv_transfer_latency_ms{{{LABELS}}} 12.5"]
        return "\n".join(lines) + "\n"

    def loads(self) -> dict:
        return {
            "timestamp": "2026-12-01T00:00:00Z",
            "version": "x",
            "loads": [
                {
                    "dp_rank": 0,
                    "num_running_reqs": 0,
                    "num_waiting_reqs": 0,
                    "max_total_num_tokens": 100000,
                    "num_used_tokens": 512 * self.inflight,
                    "disaggregation": {"prefill_bootstrap_queue_reqs": 0, "prefill_inflight_queue_reqs": self.inflight},
                }
            ],
        }

    def finish_one(self) -> None:
        """A hand-off completes: the request leaves the inflight queue and finishes."""
        self.transfers += 1
        self.requests += 1

    async def start(self) -> "FakeSGLang":
        app = web.Application()

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text=self.metrics())

        app.router.add_get("/metrics", metrics)

        async def loads(request: web.Request) -> web.Response:
            if not self.serves_loads:
                return web.Response(status=404, text="Not Found")
            assert request.query.get("include") == "disagg"
            return web.Response(text=json.dumps(self.loads()), content_type="application/json")

        app.router.add_get("/v1/loads", loads)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


async def watch(
    engine: FakeSGLang,
    session: aiohttp.ClientSession,
    detector: Detector,
    start: float,
    seconds: float,
    step: float = 10.0,
    each=None,
) -> list:
    verdicts, t = [], start
    while t <= start + seconds:
        if each is not None:
            each(engine, t)
        sample = await scrape_engine(session, engine.url, "prefill", SGLANG, clock=lambda: t)
        verdicts.append((t, sample, detector.observe("prefill-0", sample)))
        t += step
    return verdicts


@pytest.mark.parametrize("build,signal", [("histogram", "transfers_completed"), ("gauge", "requests_completed")])
async def test_the_incident_prefill_is_wedged_on_both_builds(build: str, signal: str) -> None:
    engine = await FakeSGLang(build).start()
    detector = Detector(window_s=120.0)
    try:
        async with make_session() as session:
            # Healthy first: hand-offs complete, the queue drains.
            healthy = await watch(engine, session, detector, 0.0, 200.0, each=lambda e, t: e.finish_one())
            assert not any(isinstance(v, Wedged) for _, _, v in healthy)
            # Then the incident: one request stays in the inflight queue, nothing moves.
            engine.inflight = engine.inflight_gauge = 1
            stuck = await watch(engine, session, detector, 210.0, 400.0)
    finally:
        await engine.stop()
    wedged = [(t, s, v) for t, s, v in stuck if isinstance(v, Wedged)]
    assert wedged, f"never judged wedged; last: {stuck[-1][2]}"
    t, sample, verdict = wedged[0]
    assert verdict.reason == "stuck_inflight" and t - 210.0 <= 120.0 + 20.0
    assert signal in verdict.details["progress_signals"]
    action = Action(kind="restart", pod="prefill-0", role="prefill", reason=verdict.reason, details=verdict.details)
    assert f"progress judged by {signal}" in wedge_message(action)


async def test_an_idle_older_build_with_stale_gauges_is_never_wedged() -> None:
    """No live view (/v1/loads 404) and the inflight gauge left at 1 by the last logged batch:
    the request finished after it; nothing says a hand-off is stuck."""
    engine = await FakeSGLang("gauge", loads=False).start()
    engine.inflight_gauge = 1
    try:
        async with make_session() as session:
            verdicts = await watch(engine, session, Detector(window_s=120.0), 0.0, 600.0)
    finally:
        await engine.stop()
    assert not any(isinstance(v, Wedged) for _, _, v in verdicts)
    assert not verdicts[-1][1].live_queues
