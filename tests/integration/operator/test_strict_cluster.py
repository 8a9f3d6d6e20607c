"""The real operator against the emulator made as strict as a real API server where a lenient
one hid defects (issue 32): admission plugins, RBAC-checked owner references, field managers."""

from __future__ import annotations

import asyncio

from bench.harness.kmock_cluster import ClusterClient, KubeCluster, eventually
from test_operator_kmock import PLURAL, condition, deployment, events_for, get_cr

from dsv4_operator.handlers.apply import retry_delay


async def test_owner_references_without_the_finalizers_grant_are_reported_not_retried_blindly(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory
) -> None:
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


async def test_drift_repair_removes_foreign_list_entries_and_never_duplicates(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory
) -> None:
    """Server-side apply merges list-maps by key: a forced apply keeps entries another manager
    added. The repair removes them (a hand-edited Service port, a foreign env var, an extra
    container): one port named http, the template as the operator writes it."""
    from test_drift_and_scaling import _ready

    await operator_factory(["ns1"])
    await kube_client.create(deployment("flash", "ns1"), PLURAL)
    await eventually(lambda: _ready(kube_client, "ns1", "flash"), timeout=20)
    apply = {"fieldManager": "someone-else", "force": "true"}
    await kube_client.call(
        "PATCH",
        "/api/v1/namespaces/ns1/services/flash-router",
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "flash-router", "namespace": "ns1"},
            "spec": {"ports": [{"name": "metrics", "port": 9090, "protocol": "TCP"}]},
        },
        "application/apply-patch+yaml",
        apply,
    )
    await kube_client.call(
        "PATCH",
        "/apis/apps/v1/namespaces/ns1/statefulsets/flash-decode",
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": "flash-decode", "namespace": "ns1"},
            "spec": {
                "template": {
                    "spec": {
                        "containers": [
                            {"name": "engine", "env": [{"name": "FOREIGN", "value": "1"}]},
                            {"name": "sidecar", "image": "someone/else:1"},
                        ]
                    }
                }
            },
        },
        "application/apply-patch+yaml",
        apply,
    )

    async def clean() -> bool:
        svc = await kube_client.get("v1", "services", "ns1", "flash-router")
        sts = await kube_client.get("apps/v1", "statefulsets", "ns1", "flash-decode")
        containers = sts["spec"]["template"]["spec"]["containers"]
        return (
            [p["name"] for p in svc["spec"]["ports"]] == ["http"]
            and [c["name"] for c in containers] == ["engine"]
            and "FOREIGN" not in {e["name"] for e in containers[0]["env"]}
        )

    await eventually(clean, timeout=20)
    restored = [e["message"] for e in await events_for(kube_client, "ns1", "flash") if e["reason"] == "Restored"]
    assert any("removed entries" in m and "name=metrics" in m for m in restored), restored


def _image_model(name: str) -> dict:
    return deployment(
        name,
        "ns1",
        model={
            "name": "deepseek-v4-flash",
            "path": "/models/dsv4-flash",
            "volume": {"image": {"reference": "reg/models:flash"}},
        },
    )


async def test_image_volumes_are_refused_where_the_feature_gate_is_off(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory
) -> None:
    """ImageVolume off (the default through 1.33): the API server would drop the model volume and
    its mount silently. The operator refuses with a status reason and writes no engine."""
    await operator_factory(["ns1"])
    await kube_client.create(_image_model("flash"), PLURAL)

    async def refused() -> dict:
        cond = condition(await get_cr(kube_client, "ns1", "flash"), "Degraded")
        return cond if cond.get("reason") == "ImageVolumeUnsupported" else {}

    cond = await eventually(refused, timeout=20)
    assert "ImageVolume feature gate" in cond["message"]
    assert await kube_client.get("apps/v1", "statefulsets", "ns1", "flash-prefill") is None, "nothing applied"

    cluster_with_crd.feature_gates["ImageVolume"] = True  # a cluster with the gate on keeps the volume
    await kube_client.create(_image_model("other"), PLURAL)

    async def applied() -> dict:
        return await kube_client.get("apps/v1", "statefulsets", "ns1", "other-prefill")

    sts = await eventually(applied, timeout=20)
    assert any("image" in v for v in sts["spec"]["template"]["spec"]["volumes"])


async def fight(client: ClusterClient, seconds: float, per_second: float = 5.0) -> int:
    """Another writer (manager `fighter`) changing the router Service's port several times a second."""
    import time

    writes, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        port = 9000 + writes % 2
        await client.call(
            "PATCH",
            "/api/v1/namespaces/ns1/services/flash-router",
            {"spec": {"ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}]}},
            "application/merge-patch+json",
            params={"fieldManager": "fighter"},
        )
        writes += 1
        await asyncio.sleep(1.0 / per_second)
    return writes


def operator_writes(cluster: KubeCluster, resource: str, name: str) -> int:
    return sum(
        1
        for c in cluster.recorder.calls
        if c.resource == resource
        and c.name == name
        and c.verb in ("patch", "update")
        and not c.agent.startswith(("dsv4-tests", "kmock/"))
    )


async def test_a_writer_that_keeps_changing_a_child_is_answered_with_back_off_and_one_warning(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory
) -> None:
    from test_drift_and_scaling import _ready

    await operator_factory(["ns1"])
    await kube_client.create(deployment("flash", "ns1"), PLURAL)
    await eventually(lambda: _ready(kube_client, "ns1", "flash"), timeout=20)
    before = operator_writes(cluster_with_crd, "services", "flash-router")
    writes = await fight(kube_client, seconds=8.0)
    repairs = operator_writes(cluster_with_crd, "services", "flash-router") - before
    # A repair is a JSON patch (the foreign port out) and an apply; 3 at once, then one per back-off
    # (5 s, doubling): a handful, where one per foreign write would be ~2 x 40.
    assert writes >= 30 and repairs <= 14, f"{repairs} operator writes against {writes} foreign writes"
    warnings = [e for e in await events_for(kube_client, "ns1", "flash") if e["reason"] == "FightingWriter"]
    assert (
        len(warnings) == 1 and "Service/flash-router" in warnings[0]["message"] and "fighter" in warnings[0]["message"]
    ), warnings

    async def put_back() -> bool:  # once the writer stops, the delayed repair restores the child
        svc = await kube_client.get("v1", "services", "ns1", "flash-router")
        return [p["port"] for p in svc["spec"]["ports"]] == [8000]

    await eventually(put_back, timeout=30)


async def test_every_child_kind_is_watched_by_label_selector(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory
) -> None:
    """Not cluster-wide and filtered client-side: the API server sends only the operator's children."""
    await operator_factory(["ns1"])
    await kube_client.create(deployment("flash", "ns1"), PLURAL)
    await eventually(lambda: kube_client.get("v1", "services", "ns1", "flash-router"), timeout=20)
    watches = {
        (c.group, c.resource): c.label_selector
        for c in cluster_with_crd.recorder.calls
        if c.verb == "watch" and not c.agent.startswith(("dsv4-tests", "kmock/"))
    }
    for kind in (
        ("", "services"),
        ("", "serviceaccounts"),
        ("rbac.authorization.k8s.io", "roles"),
        ("rbac.authorization.k8s.io", "rolebindings"),
        ("policy", "poddisruptionbudgets"),
        ("networking.k8s.io", "networkpolicies"),
        ("apps", "statefulsets"),
        ("apps", "deployments"),
    ):
        assert "app.kubernetes.io/managed-by=dsv4-operator" in (watches.get(kind) or ""), (kind, watches.get(kind))
