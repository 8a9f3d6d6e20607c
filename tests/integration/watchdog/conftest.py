"""Fixtures for the wedge watchdog's integration tests: the real operator (kopf, handlers, the
watchdog daemon) against the kmock-based API server over HTTP, with engine pods the tests create
themselves (the emulator has no StatefulSet controller and no kubelet; see watchdog_harness.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import kmock
import pytest_asyncio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench.harness.kmock_cluster import *  # noqa: E402,F401,F403  (fixtures: kube_client, kubeconfig, api_calls)
from bench.harness.kmock_cluster import ClusterClient  # noqa: E402
from bench.harness.operator_runner import OperatorThread, free_port  # noqa: E402
from watchdog_harness import NS, PodFarm, ScriptedEngine, WatchdogCluster  # noqa: E402

from dsv4_operator.crd import build_crd  # noqa: E402


@pytest_asyncio.fixture
async def kube_cluster() -> AsyncIterator[WatchdogCluster]:
    async with WatchdogCluster() as cluster, kmock.Server(cluster):
        cluster.register_crd(build_crd())
        yield cluster


@pytest_asyncio.fixture
async def engines() -> AsyncIterator[Callable[..., Any]]:
    started: list[ScriptedEngine] = []

    async def make(role: str, mode: str = "healthy") -> ScriptedEngine:
        engine = await ScriptedEngine(role).start()
        engine.reset(mode)
        started.append(engine)
        return engine

    yield make
    for engine in started:
        await engine.stop()


@pytest_asyncio.fixture
async def pod_farm(
    kube_client: ClusterClient, kube_cluster: WatchdogCluster
) -> AsyncIterator[Callable[[str], PodFarm]]:
    farms: list[PodFarm] = []

    def make(deployment: str) -> PodFarm:
        farm = PodFarm(kube_client, kube_cluster, deployment).start()
        farms.append(farm)
        return farm

    yield make
    for farm in farms:
        await farm.stop()


@pytest_asyncio.fixture
async def operator_factory(kubeconfig: Path) -> AsyncIterator[Callable[..., Any]]:
    running: list[OperatorThread] = []

    async def start() -> OperatorThread:
        op = OperatorThread(kubeconfig, [NS], free_port(), standalone=True)
        running.append(op)
        return await op.start()

    async def stop(op: OperatorThread) -> None:
        running.remove(op)
        await op.stop()

    start.stop = stop  # type: ignore[attr-defined]
    yield start
    for op in running:
        await op.stop()
