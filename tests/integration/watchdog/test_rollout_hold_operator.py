"""The operator tells the routers to hold while a one-replica role rolls (issue 45): the real
operator against the strict emulator, a real `dsv4 router` behind the router pod. While the
prefill StatefulSet (one replica) runs a pod of the old revision, every tick renews the router's
planned hold (POST /admin/hold with the router-admin token), so new requests wait for the new pod
instead of a 503; a settled StatefulSet gets none."""

from __future__ import annotations

import asyncio
import base64

import httpx
import pytest

from bench.harness.commands import Proc, free_port
from bench.harness.kmock_cluster import ClusterClient, eventually
from watchdog_harness import NS, PLURAL, WatchdogCluster, deployment, replicaset, router_pod, wait_metrics

pytestmark = pytest.mark.slow  # ~10 s: a router process and the operator


async def test_routers_hold_while_the_only_prefill_rolls(
    kube_cluster: WatchdogCluster, kube_client: ClusterClient, operator_factory, tmp_path
) -> None:
    await operator_factory()
    await kube_client.create(deployment("roll", remediation={"enabled": False}), PLURAL)
    secret = await eventually(lambda: kube_client.get("v1", "secrets", NS, "roll-auth"), timeout=20)
    token = base64.b64decode(secret["data"]["router-admin-token"]).decode()
    port = free_port()
    router = Proc(
        ["router", "--mono", "http://127.0.0.1:9", "--port", port],
        tmp_path / "router.log",
        env={"DSV4_ADMIN_TOKEN": token},
    )
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {token}"}
    try:
        await asyncio.to_thread(wait_metrics, url, router)
        await router_pod(kube_client, "roll-router-5d9f-0", port, await replicaset(kube_client, "roll"), "roll")
        sts = await eventually(lambda: kube_client.get("apps/v1", "statefulsets", NS, "roll-prefill"), timeout=20)
        settled = {"observedGeneration": sts["metadata"]["generation"], "currentRevision": "a", "updateRevision": "a"}
        await kube_client.patch(
            "apps/v1", "statefulsets", NS, "roll-prefill", {"status": settled}, subresource="status"
        )
        await asyncio.sleep(2.5)  # a few ticks: nothing is rolling, no hold
        assert httpx.get(url + "/admin/hold", headers=auth).json()["holding"] is False

        rolling = dict(settled, updateRevision="b")
        await kube_client.patch(
            "apps/v1", "statefulsets", NS, "roll-prefill", {"status": rolling}, subresource="status"
        )

        async def held() -> dict:
            got = (await asyncio.to_thread(httpx.get, url + "/admin/hold", headers=auth)).json()
            return got if got["holding"] else {}

        got = await eventually(held, timeout=10)
        assert "rollout of prefill" in got["reason"] and 0 < got["seconds_left"] <= 30, got
    finally:
        router.stop()
