"""Drift and scaling, with the real operator against the emulated API server:
- a child deleted or edited by hand comes back without any change to the resource (the operator
  watches every kind of child it owns);
- a role scaled from outside (`scaling: external`) keeps what an HPA or `kubectl scale` set
  (through the scale subresource, as they do); a role the operator scales is put back;
- switching a running role to `external` keeps its replica count (no fall back to 1)."""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from bench.harness.kmock_cluster import TEST_AGENT, ClusterClient, KubeCluster, eventually
from test_operator_kmock import API, PLURAL, deployment, events_for, get_cr, mark_ready

STS = ("apps/v1", "statefulsets")


async def scale(
    client: ClusterClient,
    ns: str,
    name: str,
    replicas: int,
    manager: str = "kubectl-scale",
    kind: tuple[str, str] = STS,
) -> None:
    """What `kubectl scale` and the HPA controller do: write the scale subresource."""
    api_version, plural = kind
    path = f"/apis/{api_version}/namespaces/{ns}/{plural}/{name}/scale"
    await client.call(
        "PATCH",
        path,
        {"spec": {"replicas": replicas}},
        "application/merge-patch+json",
        params={"fieldManager": manager},
    )


async def replicas_of(client: ClusterClient, ns: str, name: str, kind: tuple[str, str] = STS) -> Optional[int]:
    obj = await client.get(kind[0], kind[1], ns, name)
    return None if obj is None else obj["spec"].get("replicas", 1)


async def _generation(client: ClusterClient, ns: str, name: str) -> int:
    return (await get_cr(client, ns, name))["metadata"]["generation"]


async def _ready(client: ClusterClient, ns: str, name: str) -> Optional[dict]:
    children = [
        await client.get("v1", "services", ns, f"{name}-router"),
        await client.get("rbac.authorization.k8s.io/v1", "roles", ns, f"{name}-router"),
        await client.get("policy/v1", "poddisruptionbudgets", ns, f"{name}-decode"),
        await client.get(*STS, ns, f"{name}-decode"),
    ]
    cr = await get_cr(client, ns, name)
    observed = ((cr or {}).get("status") or {}).get("observedGeneration") == (cr or {}).get("metadata", {}).get(
        "generation"
    )
    return cr if all(children) and observed else None


async def test_hand_deleted_and_hand_edited_children_come_back(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory
) -> None:
    await operator_factory(["ns1"])
    await kube_client.create(deployment("flash", "ns1"), PLURAL)
    await eventually(lambda: _ready(kube_client, "ns1", "flash"), timeout=20)
    generation = await _generation(kube_client, "ns1", "flash")

    for api_version, plural, name in (
        ("v1", "services", "flash-router"),
        ("rbac.authorization.k8s.io/v1", "roles", "flash-router"),
        ("policy/v1", "poddisruptionbudgets", "flash-decode"),
        ("v1", "serviceaccounts", "flash-router"),
    ):
        old = await kube_client.get(api_version, plural, "ns1", name)
        await kube_client.delete(api_version, plural, "ns1", name)

        async def back() -> bool:
            new = await kube_client.get(api_version, plural, "ns1", name)
            return new is not None and new["metadata"]["uid"] != old["metadata"]["uid"]

        await eventually(back, timeout=20)

    # Hand edits: a Service port, a Role's rules, a StatefulSet's image.
    await kube_client.patch(
        "v1",
        "services",
        "ns1",
        "flash-router",
        {"spec": {"ports": [{"name": "http", "port": 9999, "targetPort": "http", "protocol": "TCP"}]}},
    )
    await kube_client.patch(
        "rbac.authorization.k8s.io/v1",
        "roles",
        "ns1",
        "flash-router",
        {"rules": [{"apiGroups": [""], "resources": ["pods", "secrets"], "verbs": ["get", "list", "watch"]}]},
    )
    await kube_client.patch(
        *STS,
        "ns1",
        "flash-decode",
        {"spec": {"template": {"spec": {"containers": [{"name": "engine", "image": "evil/image:1"}]}}}},
    )

    async def put_right() -> bool:
        svc = await kube_client.get("v1", "services", "ns1", "flash-router")
        role = await kube_client.get("rbac.authorization.k8s.io/v1", "roles", "ns1", "flash-router")
        sts = await kube_client.get(*STS, "ns1", "flash-decode")
        return (
            svc["spec"]["ports"][0]["port"] == 8000
            and role["rules"][0]["resources"] == ["pods"]
            and sts["spec"]["template"]["spec"]["containers"][0]["image"] == "reg/dsv4:1"
        )

    await eventually(put_right, timeout=20)
    assert await _generation(kube_client, "ns1", "flash") == generation, "no change to the resource was needed"
    restored = [e for e in await events_for(kube_client, "ns1", "flash") if e["reason"] == "Restored"]
    messages = " ".join(e["message"] for e in restored)
    assert "Service/flash-router was deleted" in messages and "Role/flash-router was changed" in messages


async def test_external_scaling_is_not_reverted_operator_scaling_is(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory
) -> None:
    await operator_factory(["ns1"])
    await kube_client.create(
        deployment("flash", "ns1", decode={"replicas": 3, "scaling": "external"}, prefill={"replicas": 2}), PLURAL
    )
    await eventually(lambda: _ready(kube_client, "ns1", "flash"), timeout=20)
    # The starting count of the externally scaled role is the spec's.
    await eventually(lambda: _equals(replicas_of(kube_client, "ns1", "flash-decode"), 3), timeout=20)

    # An HPA scales decode to 5; someone runs `kubectl scale` on prefill.
    await scale(kube_client, "ns1", "flash-decode", 5, manager="horizontal-pod-autoscaler")
    await scale(kube_client, "ns1", "flash-prefill", 7)
    await eventually(lambda: _equals(replicas_of(kube_client, "ns1", "flash-prefill"), 2), timeout=20)
    # ... and a reconcile of the whole resource (a spec change elsewhere) leaves decode alone too.
    await kube_client.patch(API, PLURAL, "ns1", "flash", {"spec": {"router": {"args": ["--verbose"]}}})
    await eventually(lambda: _observed(kube_client, "ns1", "flash", 2), timeout=20)
    await mark_ready(kube_client, "ns1", "flash")
    assert await replicas_of(kube_client, "ns1", "flash-decode") == 5
    await eventually(lambda: _status_ready(kube_client, "ns1", "flash", "decode", "5/5"), timeout=20)
    await eventually(lambda: _status_ready(kube_client, "ns1", "flash", "prefill", "2/2"), timeout=20)


async def test_switching_a_running_role_to_external_keeps_its_count(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory
) -> None:
    await operator_factory(["ns1"])
    await kube_client.create(deployment("flash", "ns1", decode={"replicas": 4}), PLURAL)
    await eventually(lambda: _ready(kube_client, "ns1", "flash"), timeout=20)
    await eventually(lambda: _equals(replicas_of(kube_client, "ns1", "flash-decode"), 4), timeout=20)
    await kube_client.patch(API, PLURAL, "ns1", "flash", {"spec": {"decode": {"scaling": "external"}}})
    await eventually(lambda: _observed(kube_client, "ns1", "flash", 2), timeout=20)
    assert await replicas_of(kube_client, "ns1", "flash-decode") == 4, "the hand-over kept the count"
    await scale(kube_client, "ns1", "flash-decode", 6, manager="keda")
    await kube_client.patch(
        API, PLURAL, "ns1", "flash", {"spec": {"decode": {"replicas": 1}}}
    )  # only a start value now
    await eventually(lambda: _observed(kube_client, "ns1", "flash", 3), timeout=20)
    assert await replicas_of(kube_client, "ns1", "flash-decode") == 6


async def _equals(value: Any, expected: Any) -> bool:
    return (await value) == expected


async def _observed(client: ClusterClient, ns: str, name: str, generation: int) -> bool:
    cr = await get_cr(client, ns, name)
    return ((cr or {}).get("status") or {}).get("observedGeneration") == generation


async def _status_ready(client: ClusterClient, ns: str, name: str, role: str, ready: str) -> Optional[dict]:
    cr = await get_cr(client, ns, name)
    return cr if (((cr or {}).get("status") or {}).get(role) or {}).get("ready") == ready else None


async def test_pdb_status_updates_cost_no_read_no_apply_and_no_event(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory
) -> None:
    """The disruption controller rewrites a PodDisruptionBudget's status whenever a pod it counts
    changes (the emulator does too): a status write is nobody's drift, so the operator answers it
    with no GET, no apply and no Restored Event."""
    await operator_factory(["ns1"])
    await kube_client.create(deployment("flash", "ns1"), PLURAL)
    await eventually(lambda: _ready(kube_client, "ns1", "flash"), timeout=20)
    pdb = await kube_client.get("policy/v1", "poddisruptionbudgets", "ns1", "flash-decode")
    assert pdb["status"]["observedGeneration"] == pdb["metadata"]["generation"]
    await asyncio.sleep(0.5)  # let the reconcile's own writes settle
    mark = len(cluster_with_crd.recorder.calls)
    labels = pdb["spec"]["selector"]["matchLabels"]
    for i in range(3):  # engine pods come and become ready: three status writes of the budget or more
        await kube_client.create(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"flash-decode-{i}", "namespace": "ns1", "labels": labels},
                "spec": {"containers": [{"name": "engine", "image": "reg/dsv4:1"}]},
            },
            "pods",
        )
        await kube_client.patch(
            "v1",
            "pods",
            "ns1",
            f"flash-decode-{i}",
            {"status": {"conditions": [{"type": "Ready", "status": "True"}]}},
            subresource="status",
        )

    async def counted() -> bool:
        got = await kube_client.get("policy/v1", "poddisruptionbudgets", "ns1", "flash-decode")
        return got["status"]["currentHealthy"] == 3

    await eventually(counted, timeout=10)
    await asyncio.sleep(1.0)  # time for the operator to (not) answer the watch events
    pdb_calls = [
        c
        for c in cluster_with_crd.recorder.calls[mark:]
        if c.resource.startswith("poddisruptionbudgets")
        and not c.agent.startswith(TEST_AGENT)
        and c.verb not in ("watch", "list")
    ]
    assert pdb_calls == [], pdb_calls
    restored = [
        e
        for e in await events_for(kube_client, "ns1", "flash")
        if e["reason"] == "Restored" and "PodDisruptionBudget" in e["message"]
    ]
    assert restored == []


async def test_foreign_labels_leave_pod_templates_and_selectors_and_stay_on_metadata(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory
) -> None:
    """A label someone adds to a child's metadata is theirs to keep; one in a pod template rolls
    the pods and one in a selector changes who gets traffic: those are removed (drift.py)."""
    await operator_factory(["ns1"])
    await kube_client.create(deployment("flash", "ns1"), PLURAL)
    await eventually(lambda: _ready(kube_client, "ns1", "flash"), timeout=20)
    await kube_client.patch(
        *STS,
        "ns1",
        "flash-decode",
        {
            "metadata": {"labels": {"cost-center": "ml"}},
            "spec": {"template": {"metadata": {"labels": {"example.com/sidecar": "on"}}}},
        },
    )
    await kube_client.patch("v1", "services", "ns1", "flash-router", {"spec": {"selector": {"canary": "yes"}}})

    async def put_right() -> bool:
        sts = await kube_client.get(*STS, "ns1", "flash-decode")
        svc = await kube_client.get("v1", "services", "ns1", "flash-router")
        return (
            "example.com/sidecar" not in sts["spec"]["template"]["metadata"]["labels"]
            and "canary" not in svc["spec"]["selector"]
        )

    await eventually(put_right, timeout=20)
    sts = await kube_client.get(*STS, "ns1", "flash-decode")
    assert sts["metadata"]["labels"]["cost-center"] == "ml", "a label on the child's own metadata is kept"

    async def restored() -> str:
        return " ".join(
            e["message"] for e in await events_for(kube_client, "ns1", "flash") if e["reason"] == "Restored"
        )

    # the operator posts each Restored event after its re-apply: the objects can be right first
    wanted = ("spec.template.metadata.labels[example.com/sidecar=on]", "spec.selector[canary=yes]")

    async def both_said() -> bool:
        messages = await restored()
        return all(w in messages for w in wanted)

    await eventually(both_said, timeout=10)
