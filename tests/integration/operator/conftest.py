"""Fixtures for the operator's integration tests: the kmock-based API server (shared with other
integration tests in bench/harness/kmock_cluster.py) and the operator running in a thread
(bench/harness/operator_runner.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional

import pytest


from bench.harness.kmock_cluster import *  # noqa: E402,F401,F403  (fixtures: kube_cluster, kube_client, kubeconfig, api_calls)
from bench.harness.kmock_cluster import KubeCluster  # noqa: E402
from bench.harness.operator_runner import OperatorThread, free_port  # noqa: E402,F401

from dsv4_operator.crd import build_crd  # noqa: E402


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
