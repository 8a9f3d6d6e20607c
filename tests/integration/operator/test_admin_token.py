"""The operator's own calls to a deployment's engines carry that deployment's admin token, read
from its auth Secret (not from the operator's environment): the real operator, its watchdog
daemon and a scripted engine that records the Authorization header of every admin call."""

from __future__ import annotations

import base64
import sys
from pathlib import Path
from typing import AsyncIterator

import aiohttp.web
import kmock
import pytest_asyncio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "watchdog"))  # watchdog_harness

from kmock_cluster import ClusterClient, eventually  # noqa: E402
from watchdog_harness import NS, PodFarm, ScriptedEngine, WatchdogCluster, deployment, events  # noqa: E402

from dsv4_operator.crd import build_crd  # noqa: E402


@pytest_asyncio.fixture
async def kube_cluster() -> AsyncIterator[WatchdogCluster]:
    """The shared emulator plus pods/log and DELETE preconditions (the watchdog's needs)."""
    async with WatchdogCluster() as cluster, kmock.Server(cluster):
        cluster.register_crd(build_crd())
        yield cluster


class TokenRecordingEngine(ScriptedEngine):
    def __init__(self, role: str) -> None:
        super().__init__(role)
        self.authorizations: list[tuple[str, str]] = []

    async def _admin(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        self.authorizations.append((request.path, request.headers.get("Authorization", "")))
        return await super()._admin(request)


async def test_watchdog_calls_carry_the_deployments_admin_token(kube_cluster: WatchdogCluster,
                                                                kube_client: ClusterClient, operator_factory,
                                                                monkeypatch) -> None:
    monkeypatch.setenv("DSV4_ADMIN_TOKEN", "from-the-operator-env")  # must not be what is sent
    await operator_factory([NS])
    name, pod = "healer", "healer-prefill-0"
    await kube_client.create(deployment(name, remediation={"scrapeIntervalSeconds": 0.25,
                                                           "detectionWindowSeconds": 1}), "dsv4deployments")
    secret = await eventually(lambda: kube_client.get("v1", "secrets", NS, f"{name}-auth"), timeout=20)
    token = base64.b64decode(secret["data"]["admin-token"]).decode()
    assert len(token) >= 32 and base64.b64decode(secret["data"]["pd-secret"])
    engine = await TokenRecordingEngine("prefill").start()
    farm = PodFarm(kube_client, kube_cluster, name)
    try:
        engine.reset("wedged")
        kube_cluster.pod_logs[(NS, pod)] = lambda: "log\n"
        await farm.add(pod, "prefill", engine.port)
        await eventually(lambda: events(kube_cluster, name, "Restarted"), timeout=30)
    finally:
        await engine.stop()
    assert {path for path, _ in engine.authorizations} >= {"/admin/drain", "/admin/abort"}
    assert {auth for _, auth in engine.authorizations} == {f"Bearer {token}"}
