"""Fixtures for the operator's integration tests: the kmock-based API server (shared with other
integration tests in tests/integration/kmock_cluster.py) and the operator running in a thread."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
from pathlib import Path
from typing import Iterator, Optional

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/integration: kmock_cluster

from kmock_cluster import *  # noqa: E402,F401,F403  (fixtures: kube_cluster, kube_client, kubeconfig, api_calls)
from kmock_cluster import KubeCluster  # noqa: E402

from dsv4_operator.crd import build_crd  # noqa: E402
from dsv4_operator.main import make_settings, serve_operator  # noqa: E402
from dsv4_operator.telemetry import HealthState, OperatorMetrics  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OperatorThread:
    """The real operator (kopf + handlers + health server) in its own thread and event loop,
    talking to the emulator over HTTP through a kubeconfig, as `dsv4 operator` does."""

    def __init__(self, kubeconfig: Path, namespaces: list[str], health_port: int, standalone: bool = True) -> None:
        self.kubeconfig = kubeconfig
        self.standalone = standalone
        self.namespaces = namespaces
        self.health_port = health_port
        self.state = HealthState()
        self.metrics = OperatorMetrics()
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, name="dsv4-operator", daemon=True)

    def _run(self) -> None:
        settings = make_settings(standalone=self.standalone)
        settings.watching.reconnect_backoff = 0.05
        settings.posting.level = 30  # logging.WARNING
        try:
            asyncio.run(serve_operator(
                namespaces=self.namespaces, standalone=self.standalone, health_host="127.0.0.1", health_port=self.health_port,
                kubeconfig=str(self.kubeconfig), stop_flag=self.stop_flag, ready_flag=self.ready_flag,
                settings=settings, state=self.state, metrics=self.metrics))
        except BaseException as e:  # surfaced by stop()
            self.error = e

    async def start(self, timeout: float = 15.0) -> "OperatorThread":
        self.thread.start()
        loop = asyncio.get_running_loop()
        ok = await loop.run_in_executor(None, self.ready_flag.wait, timeout)
        if not ok:
            raise RuntimeError(f"the operator did not start within {timeout}s (error: {self.error!r})")
        return self

    async def stop(self, timeout: float = 15.0) -> None:
        self.stop_flag.set()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.thread.join, timeout)
        if self.thread.is_alive():
            raise RuntimeError("the operator did not stop")


@pytest.fixture
def crd() -> dict:
    return build_crd()


@pytest.fixture
def cluster_with_crd(kube_cluster: KubeCluster, crd: dict) -> KubeCluster:
    kube_cluster.register_crd(crd)
    return kube_cluster


@pytest.fixture
async def operator_factory(kubeconfig: Path) -> Iterator:
    started: list[OperatorThread] = []

    async def start(namespaces: Optional[list[str]] = None, standalone: bool = True) -> OperatorThread:
        op = OperatorThread(kubeconfig, list(namespaces or []), free_port(), standalone)
        started.append(op)
        return await op.start()

    yield start
    for op in started:
        await op.stop()
