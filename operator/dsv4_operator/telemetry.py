"""The operator's own liveness and metrics: GET /healthz and GET /metrics on one port.

aiohttp serves them inside the operator's event loop (kopf already runs on aiohttp), so a
wedged loop fails its liveness probe instead of answering from another thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class OperatorMetrics:
    """Counters of what the operator does, in a registry of its own (not the process default)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reconciles = Counter(
            "dsv4_operator_reconciles_total",
            "Reconciliations of a DSV4Deployment, by result.",
            ["result"],
            registry=self.registry,
        )
        self.reconcile_seconds = Histogram(
            "dsv4_operator_reconcile_duration_seconds",
            "Time to apply the children of a DSV4Deployment.",
            registry=self.registry,
        )
        self.applied = Counter(
            "dsv4_operator_objects_applied_total",
            "Child objects applied (server-side apply), by kind.",
            ["kind"],
            registry=self.registry,
        )
        self.status_writes = Counter(
            "dsv4_operator_status_updates_total", "Status writes to DSV4Deployments.", registry=self.registry
        )
        self.api_errors = Counter(
            "dsv4_operator_api_errors_total",
            "Kubernetes API errors met by the handlers, by HTTP status.",
            ["status"],
            registry=self.registry,
        )
        self.deployments = Gauge(
            "dsv4_operator_deployments", "DSV4Deployments the operator currently serves.", registry=self.registry
        )
        self.up = Gauge("dsv4_operator_up", "1 while the operator runs its handlers.", registry=self.registry)
        # The wedge watchdog (dsv4_operator.remediation).
        self.wedges_detected = Counter(
            "dsv4_operator_wedges_detected_total",
            "Wedge episodes detected on engine pods, by role and reason.",
            ["role", "reason"],
            registry=self.registry,
        )
        self.remediations = Counter(
            "dsv4_operator_remediations_total",
            "Remediation steps taken (capture_evidence, drain, abort, restart, rollback) or held, by result.",
            ["action", "role", "result"],
            registry=self.registry,
        )
        self.scrape_seconds = Histogram(
            "dsv4_operator_scrape_duration_seconds",
            "Time to scrape every engine pod of a deployment, concurrently.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=self.registry,
        )
        self.scrape_errors = Counter(
            "dsv4_operator_scrape_errors_total",
            "Engine scrapes with an unanswered or failed endpoint, by role.",
            ["role"],
            registry=self.registry,
        )
        self.canary_verdicts = Counter(
            "dsv4_operator_canary_verdicts_total",
            "Canary verdicts of engine rollouts, by result (passed, failed).",
            ["result"],
            registry=self.registry,
        )
        self.canary_probe_seconds = Histogram(
            "dsv4_operator_canary_probe_duration_seconds",
            "Time from a canary pod being ready-checked to its verdict (stable and canary probes included).",
            buckets=(5, 15, 30, 60, 120, 240, 480, 900, 1800, 3600),
            registry=self.registry,
        )
        self.wedged_pods = Gauge(
            "dsv4_operator_wedged_pods",
            "Engine pods wedged or under remediation now, per deployment.",
            ["namespace", "deployment"],
            registry=self.registry,
        )
        # The planner (dsv4_operator.planner): what it decided, and the counts it wants.
        self.planner_decisions = Counter(
            "dsv4_operator_planner_decisions_total",
            "Planner decisions that changed something (scale_up, drain, scale_down), by role.",
            ["role", "action"],
            registry=self.registry,
        )
        self.planner_target = Gauge(
            "dsv4_operator_planner_target_replicas",
            "The replica count the planner last decided for a role.",
            ["namespace", "deployment", "role"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class HealthState:
    """Set by the operator's runner; read by /healthz."""

    started_at: Optional[float] = None  # kopf's startup handlers finished
    stopped_at: Optional[float] = None
    failure: Optional[str] = None  # why the operator stopped working, if it did
    standby: bool = False  # a candidate waiting for the leader Lease: alive, not acting
    created_at: float = field(default_factory=time.monotonic)


def health_verdict(state: HealthState) -> tuple[bool, str]:
    """Pure: the liveness answer for a state."""
    if state.failure:
        return False, f"failed: {state.failure}"
    if state.stopped_at is not None:
        return False, "stopped"
    if state.standby:
        return True, "standby"
    if state.started_at is None:
        return False, "starting"
    return True, "ok"


def health_app(state: HealthState, metrics: OperatorMetrics) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        ok, reason = health_verdict(state)
        return web.json_response({"status": reason}, status=200 if ok else 503)

    async def metrics_view(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics_view)
    return app


async def start_health_server(state: HealthState, metrics: OperatorMetrics, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(health_app(state, metrics), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
