"""Pods that Pod Security admission refuses, with the real operator against the emulator (issue 32):
the StatefulSet is applied (admission does not look at templates), its controller cannot make a
pod and says why in a Warning Event FailedCreate; the deployment reports Degraded=FailedCreate with
that message instead of RollingOut forever, and is no longer Degraded once the pods exist."""

from __future__ import annotations

from bench.harness.kmock_cluster import ClusterClient, KubeCluster, eventually
from test_operator_kmock import PLURAL, condition, deployment, get_cr, mark_ready


async def test_pod_security_refusal_is_degraded_with_the_controllers_message(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory
) -> None:
    await cluster_with_crd.put_namespace("ns1", {"pod-security.kubernetes.io/enforce": "baseline"})
    await operator_factory(["ns1"])
    # IPC_LOCK is outside baseline's capabilities (docs/operations.md: it needs privileged).
    await kube_client.create(deployment("flash", "ns1", security={"ipcLock": True}), PLURAL)

    async def degraded() -> dict:
        cr = await get_cr(kube_client, "ns1", "flash")
        cond = condition(cr, "Degraded")
        both = "prefill: " in cond.get("message", "") and "decode: " in cond.get("message", "")
        applied = ((cr or {}).get("status") or {}).get("observedGeneration") == 1
        return cr if cond.get("reason") == "FailedCreate" and both and applied else None

    cr = await eventually(degraded, timeout=20)
    message = condition(cr, "Degraded")["message"]
    assert condition(cr, "Degraded")["status"] == "True"
    assert "prefill: create Pod flash-prefill-0 in StatefulSet flash-prefill failed" in message
    assert 'violates PodSecurity "baseline:latest": non-default capabilities' in message and "IPC_LOCK" in message
    assert "pods cannot be created" in condition(cr, "Progressing")["message"]

    # The namespace is made privileged and the controller makes the pods: Degraded clears.
    await cluster_with_crd.put_namespace("ns1", {"pod-security.kubernetes.io/enforce": "privileged"})
    await mark_ready(kube_client, "ns1", "flash")

    async def recovered() -> bool:
        cr = await get_cr(kube_client, "ns1", "flash")
        return condition(cr, "Degraded").get("status") == "False"

    await eventually(recovered, timeout=20)
