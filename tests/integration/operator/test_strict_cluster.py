"""The real operator against the emulator made as strict as a real API server where a lenient
one hid defects (issue 32): admission plugins, RBAC-checked owner references, field managers."""

from __future__ import annotations

import asyncio

from kmock_cluster import ClusterClient, KubeCluster, eventually
from test_operator_kmock import PLURAL, condition, deployment, events_for, get_cr

from dsv4_operator.handlers import retry_delay


async def test_owner_references_without_the_finalizers_grant_are_reported_not_retried_blindly(
        cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory) -> None:
    """OwnerReferencesPermissionEnforcement on and no `update` on dsv4deployments/finalizers:
    every create is a 403. The resource says so (Degraded, naming the permission), one Warning
    per generation, the retries back off, and the watchdog says once why it waits."""
    cluster_with_crd.enforce_owner_references(set())  # the operator holds no finalizers grant
    await operator_factory(["ns1"])
    await kube_client.create(deployment("flash", "ns1"), PLURAL)

    async def degraded() -> dict:
        cond = condition(await get_cr(kube_client, "ns1", "flash"), "Degraded")
        return cond if cond.get("status") == "True" else {}

    cond = await eventually(degraded, timeout=20)
    assert cond["reason"] == "ApplyFailed"
    assert "blockOwnerDeletion" in cond["message"] and "finalizers" in cond["message"]

    async def waiting() -> list:
        return [e for e in await events_for(kube_client, "ns1", "flash") if e["reason"] == "WatchdogWaiting"]

    await eventually(waiting, timeout=20)
    await asyncio.sleep(3)
    events = await events_for(kube_client, "ns1", "flash")
    assert len([e for e in events if e["reason"] == "WatchdogWaiting"]) == 1
    assert len([e for e in events if e["reason"] == "ApplyFailed"]) == 1
    assert [retry_delay(n) for n in range(7)] == [10, 20, 40, 80, 160, 300, 300]
