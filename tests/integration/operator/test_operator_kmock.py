"""The real operator (kopf, handlers, health server) against the kmock-based API server over HTTP.

Tests stand in for the controllers the emulator lacks: they write StatefulSet/Deployment status
as kube-controller-manager would once pods are ready. The emulator's garbage collector (see
kmock_cluster.py) removes children whose owners are gone, as the real one does.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import httpx
import pytest

from bench.harness.kmock_cluster import ClusterClient, ClusterError, KubeCluster, eventually

API = "serving.dsv4.dev/v1alpha1"
PLURAL = "dsv4deployments"
WORKLOADS = (("apps/v1", "statefulsets"), ("apps/v1", "deployments"))
ALL_CHILD_KINDS = (
    ("apps/v1", "statefulsets"),
    ("apps/v1", "deployments"),
    ("v1", "services"),
    ("v1", "serviceaccounts"),
    ("rbac.authorization.k8s.io/v1", "roles"),
    ("rbac.authorization.k8s.io/v1", "rolebindings"),
)


def deployment(name: str, namespace: str, **spec: Any) -> dict:
    body = {
        "model": {
            "name": "deepseek-v4-flash",
            "path": "/models/dsv4-flash",
            "volume": {"persistentVolumeClaim": {"claimName": "models"}},
        },
        "engine": {"image": "reg/dsv4:1"},
    }
    body.update(spec)
    return {
        "apiVersion": API,
        "kind": "DSV4Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": body,
    }


async def get_cr(client: ClusterClient, ns: str, name: str) -> Optional[dict]:
    return await client.get(API, PLURAL, ns, name)


def condition(cr: Optional[dict], ctype: str) -> dict:
    for c in ((cr or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == ctype:
            return c
    return {}


def container(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]["containers"][0]


def env_of(workload: dict) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in container(workload).get("env", [])}


async def children_of(client: ClusterClient, ns: str, name: str) -> dict[tuple[str, str], dict]:
    found = {}
    for api_version, plural in ALL_CHILD_KINDS:
        for obj in await client.list(api_version, plural, ns, f"app.kubernetes.io/instance={name}"):
            found[(obj["kind"], obj["metadata"]["name"])] = obj
    return found


async def mark_ready(client: ClusterClient, ns: str, name: str) -> None:
    """Stand in for the StatefulSet / Deployment controllers: every desired pod is up and ready."""
    for api_version, plural in WORKLOADS:
        for obj in await client.list(api_version, plural, ns, f"app.kubernetes.io/instance={name}"):
            n = obj["spec"].get("replicas", 1)
            await client.patch(
                api_version,
                plural,
                ns,
                obj["metadata"]["name"],
                {
                    "status": {
                        "observedGeneration": obj["metadata"]["generation"],
                        "replicas": n,
                        "readyReplicas": n,
                        "updatedReplicas": n,
                        "availableReplicas": n,
                    }
                },
                subresource="status",
            )


async def events_for(client: ClusterClient, ns: str, name: str) -> list[dict]:
    return [e for e in await client.list("v1", "events", ns) if e["involvedObject"].get("name") == name]


async def test_apply_creates_children_and_reports_status(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory, api_calls
) -> None:
    op = await operator_factory(["ns1"])
    created = await kube_client.create(deployment("flash", "ns1", transfer={"ucxNetDevices": "mlx5_0:1"}), PLURAL)
    uid = created["metadata"]["uid"]

    children = await eventually(lambda: _all_children(kube_client, "ns1", "flash"))
    for (kind, child_name), child in children.items():
        assert child["metadata"]["ownerReferences"][0]["uid"] == uid, (kind, child_name)
        assert child["metadata"]["labels"]["app.kubernetes.io/name"] == "dsv4"
    prefill = children[("StatefulSet", "flash-prefill")]
    assert container(prefill)["name"] == "engine"
    assert container(prefill)["ports"][0]["name"] == "http"
    assert container(prefill)["command"][:6] == ["dsv4", "serve", "--model", "/models/dsv4-flash", "--role", "prefill"]
    assert container(prefill)["resources"]["limits"]["nvidia.com/gpu"] == "4"  # served canonical, as a quantity
    assert env_of(prefill)["UCX_NET_DEVICES"] == "mlx5_0:1"
    assert prefill["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.family": "blackwell"}
    router = children[("Deployment", "flash-router")]
    assert "--discover-namespace" in container(router)["command"]

    # Status: the operator acted on generation 1; nothing is ready yet.
    cr = await eventually(lambda: _with_status(kube_client, "ns1", "flash", observed=1))
    assert condition(cr, "Available")["status"] == "False"
    assert condition(cr, "Progressing")["status"] == "True"
    assert condition(cr, "Degraded")["status"] == "False"
    assert condition(cr, "Wedged")["status"] == "Unknown"
    assert cr["status"]["prefill"]["ready"] == "0/1"
    assert cr["status"]["revision"]

    # The controllers report ready pods: the status follows without any change to the spec.
    await mark_ready(kube_client, "ns1", "flash")

    async def available() -> Optional[dict]:
        cr = await get_cr(kube_client, "ns1", "flash")
        return cr if condition(cr, "Available").get("status") == "True" else None

    cr = await eventually(available)
    assert condition(cr, "Progressing")["status"] == "False"
    assert {r: cr["status"][r]["ready"] for r in ("prefill", "decode", "router")} == {
        "prefill": "1/1",
        "decode": "1/1",
        "router": "1/1",
    }
    assert cr["status"]["observedGeneration"] == 1

    events = await eventually(lambda: events_for(kube_client, "ns1", "flash"))
    assert any(e["reason"] == "Applied" and e["type"] == "Normal" for e in events)

    # Its own liveness and metrics.
    async with httpx.AsyncClient() as http:
        health = await http.get(f"http://127.0.0.1:{op.health_port}/healthz")
        metrics = await http.get(f"http://127.0.0.1:{op.health_port}/metrics")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert 'dsv4_operator_reconciles_total{result="applied"} 1.0' in metrics.text
    assert 'dsv4_operator_objects_applied_total{kind="StatefulSet"} 2.0' in metrics.text

    # What the operator called, for the Helm chart's RBAC (the tests' own calls are not counted).
    observed = api_calls.observed()
    assert {
        ("watch", "serving.dsv4.dev", "dsv4deployments"),
        ("patch", "serving.dsv4.dev", "dsv4deployments"),
        ("patch", "serving.dsv4.dev", "dsv4deployments/status"),
        ("get", "serving.dsv4.dev", "dsv4deployments"),
        ("create", "apps", "statefulsets"),
        ("patch", "apps", "statefulsets"),
        ("watch", "apps", "statefulsets"),
        ("create", "", "events"),
        ("patch", "rbac.authorization.k8s.io", "roles"),
    } <= observed
    assert ("create", "serving.dsv4.dev", "dsv4deployments") not in observed  # that was the test


async def _all_children(client: ClusterClient, ns: str, name: str) -> Optional[dict]:
    children = await children_of(client, ns, name)
    return children if len(children) == 9 else None


async def _with_status(client: ClusterClient, ns: str, name: str, observed: int) -> Optional[dict]:
    cr = await get_cr(client, ns, name)
    return cr if (cr or {}).get("status", {}).get("observedGeneration") == observed else None


async def test_update_rolls_through_to_the_children(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory
) -> None:
    await operator_factory(["ns1"])
    await kube_client.create(
        deployment("flash", "ns1", decode={"env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]}), PLURAL
    )
    await eventually(lambda: _with_status(kube_client, "ns1", "flash", observed=1))

    await kube_client.patch(
        API,
        PLURAL,
        "ns1",
        "flash",
        {
            "spec": {
                "engine": {"image": "reg/dsv4:2"},
                "prefill": {"replicas": 3, "nodeSelector": {"nvidia.com/gpu.family": None, "pool": "b200"}},
                "decode": {"env": [{"name": "A", "value": "10"}]},
                "router": {"replicas": 2},
            }
        },
    )

    async def rolled() -> Optional[dict]:
        children = await children_of(kube_client, "ns1", "flash")
        prefill, decode = children[("StatefulSet", "flash-prefill")], children[("StatefulSet", "flash-decode")]
        return children if prefill["spec"]["replicas"] == 3 and container(decode)["image"] == "reg/dsv4:2" else None

    await eventually(lambda: _with_status(kube_client, "ns1", "flash", observed=2))  # the reconcile is done
    children = await eventually(rolled)
    prefill, decode = children[("StatefulSet", "flash-prefill")], children[("StatefulSet", "flash-decode")]
    assert container(prefill)["image"] == container(decode)["image"] == "reg/dsv4:2"
    assert container(children[("Deployment", "flash-router")])["image"] == "reg/dsv4:2"
    assert children[("Deployment", "flash-router")]["spec"]["replicas"] == 2
    assert env_of(decode)["A"] == "10" and "B" not in env_of(decode)
    # The key dropped from the spec is dropped from the child too (server-side apply prunes it).
    assert prefill["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "b200"}
    cr = await eventually(lambda: _with_status(kube_client, "ns1", "flash", observed=2))
    assert cr["status"]["prefill"]["ready"] == "0/3"


async def test_deleting_the_resource_leaves_nothing_it_owned(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory
) -> None:
    await operator_factory(["ns1"])
    await kube_client.create(deployment("flash", "ns1"), PLURAL)
    await eventually(lambda: _all_children(kube_client, "ns1", "flash"))
    await eventually(lambda: _with_status(kube_client, "ns1", "flash", observed=1))

    await kube_client.delete(API, PLURAL, "ns1", "flash")

    async def gone() -> bool:
        return not await children_of(kube_client, "ns1", "flash") and await get_cr(kube_client, "ns1", "flash") is None

    await eventually(gone)
    # ... and the operator does not bring any of it back.
    import asyncio

    await asyncio.sleep(0.5)
    assert await gone()
    assert not [o for o in cluster_with_crd.objects_of("apps/v1/statefulsets", "ns1")]


async def test_two_namespaces_do_not_interfere(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory
) -> None:
    await operator_factory()  # all namespaces
    await kube_client.create(deployment("flash", "ns1"), PLURAL)
    await kube_client.create(deployment("flash", "ns2", engine={"kind": "sglang", "image": "sgl:1"}), PLURAL)
    first = await eventually(lambda: _all_children(kube_client, "ns1", "flash"))
    second = await eventually(lambda: _all_children(kube_client, "ns2", "flash"))
    assert container(first[("StatefulSet", "flash-prefill")])["command"][0] == "dsv4"
    assert container(second[("StatefulSet", "flash-prefill")])["command"][:3] == [
        "python3",
        "-m",
        "sglang.launch_server",
    ]
    assert "--discover-namespace" in container(first[("Deployment", "flash-router")])["command"]
    router2 = container(second[("Deployment", "flash-router")])["command"]
    assert router2[router2.index("--service-discovery-namespace") + 1] == "ns2"

    # Only ns2 becomes ready; only ns2 says so.
    await mark_ready(kube_client, "ns2", "flash")

    async def ns2_available() -> bool:
        return condition(await get_cr(kube_client, "ns2", "flash"), "Available").get("status") == "True"

    await eventually(ns2_available)
    assert condition(await get_cr(kube_client, "ns1", "flash"), "Available")["status"] == "False"

    # Scaling ns1 leaves ns2 as it was; deleting ns1 leaves ns2's children.
    await kube_client.patch(API, PLURAL, "ns1", "flash", {"spec": {"decode": {"replicas": 4}}})

    async def ns1_scaled() -> bool:
        sts = await kube_client.get("apps/v1", "statefulsets", "ns1", "flash-decode")
        return sts["spec"]["replicas"] == 4

    await eventually(ns1_scaled)
    assert (await kube_client.get("apps/v1", "statefulsets", "ns2", "flash-decode"))["spec"]["replicas"] == 1
    await kube_client.delete(API, PLURAL, "ns1", "flash")
    await eventually(lambda: _no_children(kube_client, "ns1", "flash"))
    assert len(await children_of(kube_client, "ns2", "flash")) == 9
    assert condition(await get_cr(kube_client, "ns2", "flash"), "Available")["status"] == "True"


async def _no_children(client: ClusterClient, ns: str, name: str) -> bool:
    return not await children_of(client, ns, name)


async def test_namespaced_operator_ignores_other_namespaces(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory
) -> None:
    # Not standalone: with no kopf peering resources in the cluster it runs alone anyway.
    await operator_factory(["ns1"], standalone=False)
    await kube_client.create(deployment("other", "ns2"), PLURAL)
    await kube_client.create(deployment("mine", "ns1"), PLURAL)
    await eventually(lambda: _all_children(kube_client, "ns1", "mine"))
    assert not await children_of(kube_client, "ns2", "other")
    assert "status" not in await get_cr(kube_client, "ns2", "other")


async def test_broken_spec_yields_a_condition_not_a_crash_loop(
    kube_cluster: KubeCluster, crd: dict, kube_client: ClusterClient, operator_factory
) -> None:
    # An older CRD without the minimums lets replicas < 0 through to the operator.
    old = copy.deepcopy(crd)
    role = old["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["prefill"]
    del role["properties"]["replicas"]["minimum"]
    kube_cluster.register_crd(old)
    op = await operator_factory(["ns1"])
    await kube_client.create(deployment("flash", "ns1", prefill={"replicas": -1}), PLURAL)

    cr = await eventually(lambda: _with_status(kube_client, "ns1", "flash", observed=1))
    degraded = condition(cr, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
    assert "spec.prefill.replicas" in degraded["message"]
    assert condition(cr, "Progressing")["reason"] == "InvalidSpec"
    assert not await children_of(kube_client, "ns1", "flash")
    warnings = await eventually(
        lambda: [e for e in _sync_events(kube_cluster, "flash") if e["reason"] == "InvalidSpec"]
    )
    assert warnings[0]["type"] == "Warning"

    # No retry loop: it said so once and went quiet; and it is still alive.
    import asyncio

    await asyncio.sleep(1.5)
    assert len([e for e in _sync_events(kube_cluster, "flash") if e["reason"] == "InvalidSpec"]) == 1
    assert op.thread.is_alive() and op.error is None
    async with httpx.AsyncClient() as http:
        assert (await http.get(f"http://127.0.0.1:{op.health_port}/healthz")).status_code == 200
        metrics = (await http.get(f"http://127.0.0.1:{op.health_port}/metrics")).text
    assert 'dsv4_operator_reconciles_total{result="invalid_spec"} 1.0' in metrics

    # Fixing the spec clears it.
    await kube_client.patch(API, PLURAL, "ns1", "flash", {"spec": {"prefill": {"replicas": 1}}})
    await eventually(lambda: _all_children(kube_client, "ns1", "flash"))
    cr = await eventually(lambda: _with_status(kube_client, "ns1", "flash", observed=2))
    assert condition(cr, "Degraded")["status"] == "False"


def _sync_events(cluster: KubeCluster, name: str) -> list[dict]:
    return [e for e in cluster.objects_of("v1/events") if e["involvedObject"].get("name") == name]


async def test_the_crd_schema_rejects_what_the_operator_cannot_run(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient
) -> None:
    with pytest.raises(ClusterError) as err:
        await kube_client.create(deployment("flash", "ns1", prefill={"replicas": -1}), PLURAL)
    assert err.value.status == 422 and "replicas" in err.value.body["message"]
    created = await kube_client.create(deployment("flash", "ns1"), PLURAL)
    assert created["spec"]["remediation"]["rollback"] == "suggest"  # defaults filled in by the schema


async def test_a_deleted_child_is_put_back(
    cluster_with_crd: KubeCluster, kube_client: ClusterClient, operator_factory
) -> None:
    await operator_factory(["ns1"])
    await kube_client.create(deployment("flash", "ns1"), PLURAL)
    children = await eventually(lambda: _all_children(kube_client, "ns1", "flash"))
    old_uid = children[("StatefulSet", "flash-decode")]["metadata"]["uid"]
    await kube_client.delete("apps/v1", "statefulsets", "ns1", "flash-decode")

    async def restored() -> bool:
        sts = await kube_client.get("apps/v1", "statefulsets", "ns1", "flash-decode")
        return sts is not None and sts["metadata"]["uid"] != old_uid

    await eventually(restored)
