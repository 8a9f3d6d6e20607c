"""The operator's watchdog watches the router pods too (issue 45), on the strict emulator with real
`dsv4 router` processes behind the router pods: a router frozen by SIGSTOP (sockets open, /metrics
unanswered) is reported Wedged with its evidence (Event + status.routers) and, while another
router replica is ready and answering, evicted; the last one standing is reported only."""

from __future__ import annotations

import asyncio
import os
import signal


import pytest

from bench.harness.commands import Proc, free_port
from bench.harness.kmock_cluster import ClusterClient, eventually
from watchdog_harness import (
    PLURAL,
    PodFarm,
    WatchdogCluster,
    deployment,
    events,
    get_cr,
    replicaset,
    router_pod,
    wait_metrics,
)

pytestmark = pytest.mark.slow  # ~15 s: two router processes, two detection windows with scrape timeouts


async def test_a_frozen_router_pod_is_restarted_beside_a_ready_one_and_the_last_one_reported(
    kube_cluster: WatchdogCluster, kube_client: ClusterClient, pod_farm, engines, operator_factory, tmp_path
) -> None:
    ports = [free_port(), free_port()]
    routers = [
        Proc(["router", "--mono", "http://127.0.0.1:9", "--port", p], tmp_path / f"router{i}.log")
        for i, p in enumerate(ports)
    ]
    try:
        await operator_factory()
        farm: PodFarm = pod_farm("edge")
        await kube_client.create(deployment("edge", remediation={}), PLURAL)
        for pod, role in (("edge-prefill-0", "prefill"), ("edge-decode-0", "decode")):
            await farm.add(pod, role, (await engines(role)).port)
        rs = await replicaset(kube_client)
        for i, p in enumerate(ports):
            await asyncio.to_thread(wait_metrics, f"http://127.0.0.1:{p}", routers[i])
            await router_pod(kube_client, f"edge-router-5d9f-{i}", p, rs)

        async def seen(states: dict) -> bool:
            got = {
                p["pod"]: p["state"]
                for p in ((await get_cr(kube_client, "edge")).get("status") or {}).get("routers", {}).get("pods", [])
            }
            return got == states

        await eventually(lambda: seen({"edge-router-5d9f-0": "Healthy", "edge-router-5d9f-1": "Healthy"}), timeout=20)

        os.kill(routers[0].popen.pid, signal.SIGSTOP)
        await eventually(lambda: _evicted(kube_cluster, "edge-router-5d9f-0"), timeout=20)
        # kopf posts Events in the background: the eviction may be seen first
        [said] = await eventually(
            lambda: [e for e in events(kube_cluster, "edge", "WedgeDetected") if _about(e, "edge-router-5d9f-0")],
            timeout=5,
        )
        assert "unresponsive" in said["message"] and "silent_seconds" in said["message"], said
        await eventually(lambda: events(kube_cluster, "edge", "RouterRestarted"), timeout=5)

        async def restarted() -> dict:
            return ((await get_cr(kube_client, "edge")).get("status") or {}).get("routers", {}).get("lastRestart")

        last = await eventually(restarted, timeout=5)
        assert last["pod"] == "edge-router-5d9f-0" and last["reason"] == "unresponsive" and last["evidence"], last

        os.kill(routers[1].popen.pid, signal.SIGSTOP)  # the last router: reported, not restarted
        await eventually(lambda: _said(kube_cluster, "edge-router-5d9f-1"), timeout=20)
        [said] = [e for e in events(kube_cluster, "edge", "WedgeDetected") if _about(e, "edge-router-5d9f-1")]
        assert "reported only" in said["message"], said
        await asyncio.sleep(1.5)  # a few more rounds: still not evicted, said once
        assert [name for name, _ in kube_cluster.evictions] == ["edge-router-5d9f-0"]
        assert len([e for e in events(kube_cluster, "edge", "WedgeDetected") if _about(e, "edge-router-5d9f-1")]) == 1
        cr = await get_cr(kube_client, "edge")
        [r1] = cr["status"]["routers"]["pods"]
        assert r1["pod"] == "edge-router-5d9f-1" and r1["state"] == "Wedged" and r1["details"]["silent_seconds"] >= 2
    finally:
        for r in routers:
            try:
                os.kill(r.popen.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            r.stop()


async def _evicted(cluster: WatchdogCluster, pod: str) -> bool:
    return any(name == pod for name, _ in cluster.evictions)


async def _said(cluster: WatchdogCluster, pod: str) -> bool:
    return any(_about(e, pod) for e in events(cluster, "edge", "WedgeDetected"))


def _about(event: dict, pod: str) -> bool:
    return event["message"].startswith(f"{pod} (router)")
