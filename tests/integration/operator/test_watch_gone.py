"""Watches that end and cannot resume, with the real operator against the emulator (issue 32).

A real API server keeps a window of events; a watch that resumes from before it (after a long
disconnect, an API server restart, etcd compaction) is answered 410 Gone and its client must list
again. Here every watch is taken down, the resource and a child are changed while none is open,
the history is compacted, and the watches come back: kopf is told 410, relists, and what changed
meanwhile is still acted on (the new spec applied, the hand edit put right)."""

from __future__ import annotations

from bench.harness.kmock_cluster import ClusterClient, KubeCluster, eventually
from test_drift_and_scaling import STS, _ready
from test_operator_kmock import API, PLURAL, container, deployment, get_cr


async def test_changes_made_while_watches_are_gone_are_reconciled_after_410_and_relist(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory
) -> None:
    cluster_with_crd.bookmark_interval = 0.5
    await operator_factory(["ns1"])
    await kube_client.create(deployment("flash", "ns1"), PLURAL)
    await eventually(lambda: _ready(kube_client, "ns1", "flash"), timeout=20)

    async with cluster_with_crd.watches_down():
        await kube_client.patch(API, PLURAL, "ns1", "flash", {"spec": {"engine": {"image": "reg/dsv4:2"}}})
        await kube_client.patch(
            "v1",
            "services",
            "ns1",
            "flash-router",
            {"spec": {"ports": [{"name": "http", "port": 9999, "targetPort": "http", "protocol": "TCP"}]}},
        )
    gone = [c for c in cluster_with_crd.recorder.calls if c.verb == "watch"]

    async def caught_up() -> bool:
        cr = await get_cr(kube_client, "ns1", "flash")
        sts = await kube_client.get(*STS, "ns1", "flash-decode")
        svc = await kube_client.get("v1", "services", "ns1", "flash-router")
        return (
            cr["status"].get("observedGeneration") == cr["metadata"]["generation"]
            and container(sts)["image"] == "reg/dsv4:2"
            and [p["port"] for p in svc["spec"]["ports"]] == [8000]
        )

    await eventually(caught_up, timeout=30)
    relists = [
        c
        for c in cluster_with_crd.recorder.calls[len(gone) :]
        if c.verb == "list" and c.resource in ("dsv4deployments", "services")
    ]
    assert {c.resource for c in relists} == {"dsv4deployments", "services"}, "kopf listed again after 410"


async def test_a_hand_edit_made_while_watches_are_gone_is_put_right_after_the_relist(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory
) -> None:
    """No change to the resource this time: only the relisted child shows the drift (kopf's
    relist delivers it as a listing event, not as MODIFIED)."""
    await operator_factory(["ns1"])
    await kube_client.create(deployment("flash", "ns1"), PLURAL)
    await eventually(lambda: _ready(kube_client, "ns1", "flash"), timeout=20)
    async with cluster_with_crd.watches_down():
        await kube_client.patch(
            "rbac.authorization.k8s.io/v1",
            "roles",
            "ns1",
            "flash-router",
            {"rules": [{"apiGroups": [""], "resources": ["pods", "secrets"], "verbs": ["get", "list", "watch"]}]},
        )

    async def put_right() -> bool:
        role = await kube_client.get("rbac.authorization.k8s.io/v1", "roles", "ns1", "flash-router")
        return role["rules"][0]["resources"] == ["pods"]

    await eventually(put_right, timeout=20)
