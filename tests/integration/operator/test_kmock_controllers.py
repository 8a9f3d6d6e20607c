"""The emulator's Pod Security admission, its controllers' answers (StatefulSet FailedCreate, PDB
status) and its watches (history, 410 Gone, bookmarks), each as a real kube-apiserver and
kube-controller-manager (1.29-1.33) behave (issue 32)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Optional

import aiohttp
import pytest
from bench.harness.kmock_cluster import ClusterClient, ClusterError, KubeCluster, eventually
from bench.harness.pod_security import violations

NS = "psa"


def pod_spec(**security: Any) -> dict:
    """A pod spec as the operator builds an engine's: restricted unless told otherwise."""
    container = {
        "name": "engine",
        "image": "reg/dsv4:1",
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    if security.get("ipc_lock"):
        container["securityContext"]["capabilities"]["add"] = ["IPC_LOCK"]
    spec = {
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}, "runAsNonRoot": True},
        "containers": [container],
        "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
    }
    if security.get("host_path"):
        spec["volumes"].append({"name": "model", "hostPath": {"path": "/models"}})
    if security.get("root"):
        del spec["securityContext"]["runAsNonRoot"]
    return spec


@pytest.mark.parametrize(
    "options,level,refused",
    [
        ({}, "restricted", []),
        ({"ipc_lock": True}, "baseline", ["non-default capabilities"]),
        ({"ipc_lock": True}, "restricted", ["non-default capabilities", "unrestricted capabilities"]),
        ({"host_path": True}, "baseline", ["hostPath volumes"]),
        ({"host_path": True}, "restricted", ["hostPath volumes", "restricted volume types"]),
        ({"root": True}, "baseline", []),
        ({"root": True}, "restricted", ["runAsNonRoot != true"]),
        ({"ipc_lock": True, "host_path": True, "root": True}, "privileged", []),
    ],
)
def test_pod_security_levels(options: dict, level: str, refused: list[str]) -> None:
    found = violations(pod_spec(**options), level)
    assert [f.split(" (")[0] for f in found] == refused, found


async def namespace(cluster: KubeCluster, name: str, level: Optional[str]) -> None:
    await cluster.put_namespace(name, {"pod-security.kubernetes.io/enforce": level} if level else {})


def statefulset(name: str, spec: dict, replicas: int = 1) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": spec},
        },
    }


async def test_pod_security_refuses_pods_and_the_statefulset_controller_says_failed_create(
    kube_cluster: KubeCluster, kube_client: ClusterClient
) -> None:
    await namespace(kube_cluster, NS, "baseline")
    with pytest.raises(ClusterError) as err:  # a pod made directly: admission's 403
        await kube_client.create(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "p", "namespace": NS},
                "spec": pod_spec(host_path=True),
            },
            "pods",
        )
    assert err.value.status == 403
    assert 'violates PodSecurity "baseline:latest": hostPath volumes (volume "model")' in err.value.body["message"]
    # A StatefulSet is admitted (its pods are made by the controller), which cannot make them.
    await kube_client.create(statefulset("locked", pod_spec(ipc_lock=True)), "statefulsets")
    await kube_client.create(statefulset("fine", pod_spec()), "statefulsets")
    await kube_client.create(statefulset("none", pod_spec(ipc_lock=True), replicas=0), "statefulsets")
    events = await kube_client.call(
        "GET",
        f"/api/v1/namespaces/{NS}/events",
        params={"fieldSelector": "reason=FailedCreate,involvedObject.kind=StatefulSet"},
    )
    (event,) = events["items"]
    assert event["type"] == "Warning" and event["involvedObject"]["name"] == "locked"
    assert event["source"]["component"] == "statefulset-controller"
    assert event["message"].startswith(
        'create Pod locked-0 in StatefulSet locked failed error: pods "locked-0" '
        'is forbidden: violates PodSecurity "baseline:latest": non-default capabilities'
    )
    with pytest.raises(ClusterError) as err:  # a field a real API server does not select events by
        await kube_client.call("GET", f"/api/v1/namespaces/{NS}/events", params={"fieldSelector": "message=x"})
    assert err.value.status == 400


async def test_pdb_status_follows_generation_and_pods_as_a_status_write(
    kube_cluster: KubeCluster, kube_client: ClusterClient
) -> None:
    pdb = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "b", "namespace": "ns"},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "e"}}},
    }
    await kube_client.create(pdb, "poddisruptionbudgets")
    got = await kube_client.get("policy/v1", "poddisruptionbudgets", "ns", "b")
    assert got["status"]["observedGeneration"] == 1 and got["status"]["expectedPods"] == 0
    for i in range(2):
        await kube_client.create(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"e-{i}", "namespace": "ns", "labels": {"app": "e"}},
                "spec": {"containers": [{"name": "c", "image": "i"}]},
            },
            "pods",
        )
        await kube_client.patch(
            "v1",
            "pods",
            "ns",
            f"e-{i}",
            {"status": {"conditions": [{"type": "Ready", "status": "True"}]}},
            subresource="status",
        )  # the kubelet's report
    got = await kube_client.get("policy/v1", "poddisruptionbudgets", "ns", "b")
    assert (got["status"]["currentHealthy"], got["status"]["disruptionsAllowed"]) == (2, 1)
    await kube_client.patch("policy/v1", "poddisruptionbudgets", "ns", "b", {"spec": {"maxUnavailable": 0}})
    got = await kube_client.get("policy/v1", "poddisruptionbudgets", "ns", "b")
    assert got["metadata"]["generation"] == 2 and got["status"]["observedGeneration"] == 2
    assert got["status"]["disruptionsAllowed"] == 0
    status_writers = [m for m in got["metadata"]["managedFields"] if m.get("subresource") == "status"]
    assert [m["manager"] for m in status_writers] == ["kube-controller-manager"]


async def watch(cluster: KubeCluster, path: str, params: dict, until: int, timeout: float = 5.0) -> list[dict]:
    """The events of one watch request, up to `until` of them (or the stream's end)."""
    out: list[dict] = []
    async with aiohttp.ClientSession() as session:
        async with session.get(str(cluster.url).rstrip("/") + path, params={"watch": "true", **params}) as resp:
            assert resp.status == 200

            async def read() -> None:
                async for line in resp.content:
                    if line.strip():
                        out.append(json.loads(line))
                        if len(out) >= until:
                            return

            await asyncio.wait_for(read(), timeout)
    return out


def configmap(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": "ns"}, "data": {"k": name}}


async def test_watch_resumes_from_history_then_410_after_compaction_and_bookmarks(
    kube_cluster: KubeCluster, kube_client: ClusterClient
) -> None:
    path = "/api/v1/namespaces/ns/configmaps"
    first = await kube_client.create(configmap("a"), "configmaps")
    since = first["metadata"]["resourceVersion"]
    await kube_client.create(configmap("b"), "configmaps")
    await kube_client.delete("v1", "configmaps", "ns", "a")
    # From a resourceVersion: the events after it, a deletion included (not a fresh snapshot).
    replay = await watch(kube_cluster, path, {"resourceVersion": since}, until=2)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in replay] == [("ADDED", "b"), ("DELETED", "a")]
    # After compaction, resuming from before it is 410 Gone: the client must list again.
    kube_cluster.compact()
    (gone,) = await watch(kube_cluster, path, {"resourceVersion": since}, until=1)
    assert gone["type"] == "ERROR" and gone["object"]["code"] == 410
    # A quiet watch that asks for bookmarks gets one with the newest resourceVersion.
    kube_cluster.bookmark_interval = 0.2
    listed = await kube_client.call("GET", path)
    await kube_client.create(
        {**configmap("other"), "metadata": {"name": "other", "namespace": "elsewhere"}}, "configmaps"
    )
    (mark,) = await watch(
        kube_cluster,
        path,
        {"resourceVersion": listed["metadata"]["resourceVersion"], "allowWatchBookmarks": "true"},
        until=1,
    )
    assert mark["type"] == "BOOKMARK"
    assert int(mark["object"]["metadata"]["resourceVersion"]) > int(listed["metadata"]["resourceVersion"])


async def test_watches_down_ends_watches_and_what_was_written_meanwhile_needs_a_relist(
    kube_cluster: KubeCluster, kube_client: ClusterClient
) -> None:
    path = "/api/v1/namespaces/ns/configmaps"
    made = await kube_client.create(configmap("a"), "configmaps")
    rv = made["metadata"]["resourceVersion"]
    open_watch = asyncio.ensure_future(watch(kube_cluster, path, {"resourceVersion": rv}, until=5))
    await eventually(lambda: sum(len(q) for q in kube_cluster._watchers.values()) == 1)
    async with kube_cluster.watches_down():
        assert await open_watch == [], "the open watch ended without an event"
        await kube_client.patch("v1", "configmaps", "ns", "a", {"data": {"k": "changed"}})
    (gone,) = await watch(kube_cluster, path, {"resourceVersion": rv}, until=1)
    assert gone["object"]["code"] == 410
