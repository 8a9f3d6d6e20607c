"""Router discovery: the pure pod -> worker rule, and the real watch against the emulated
Kubernetes API (kmock): pods join, draining pods and deleted pods leave."""

from __future__ import annotations

import asyncio


from bench.harness.kmock_cluster import *  # noqa: E402,F401,F403  (fixtures: kube_cluster, kube_client, kubeconfig)
from bench.harness.kmock_cluster import eventually  # noqa: E402

from dsv4_router.router import Router  # noqa: E402
from dsv4_router.router_args import RouterArgs  # noqa: E402
from dsv4_router.discovery import pod_worker, sync, watch_pods  # noqa: E402


def pod(name, role="prefill", ip="10.0.0.1", phase="Running", port=8100, draining=False, instance="flash", owner=None):
    labels = {"app.kubernetes.io/instance": instance, "serving.dsv4.dev/role": role}
    if draining:
        labels["serving.dsv4.dev/draining"] = "true"
    refs = (
        []
        if owner is None
        else [
            {
                "apiVersion": "apps/v1",
                "kind": owner[0],
                "name": owner[1],
                "uid": "u-1",
                "controller": owner[2] if len(owner) > 2 else True,
            }
        ]
    )
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "serving", "labels": labels, "ownerReferences": refs},
        "spec": {"containers": [{"name": "engine", "image": "x", "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {"phase": phase, "podIP": ip},
    }


def test_pod_worker_rule():
    assert pod_worker(pod("a", port=8200)) == ("http://10.0.0.1:8200", "prefill")
    assert pod_worker(pod("a", role="router")) is None
    assert pod_worker(pod("a", draining=True)) is None
    assert pod_worker(pod("a", phase="Pending")) is None
    assert pod_worker(pod("a", ip=None)) is None
    gone = pod("a")
    gone["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert pod_worker(gone) is None


def test_with_owners_only_pods_controlled_by_those_statefulsets_are_workers():
    owners = ["flash-prefill", "flash-decode"]
    assert pod_worker(pod("a", owner=("StatefulSet", "flash-prefill")), owners) == ("http://10.0.0.1:8100", "prefill")
    # The right labels on a pod someone else made: no traffic, no PD secret (issue 27).
    assert pod_worker(pod("a"), owners) is None
    assert pod_worker(pod("a", owner=("StatefulSet", "evil")), owners) is None
    assert pod_worker(pod("a", owner=("ReplicaSet", "flash-prefill")), owners) is None
    assert pod_worker(pod("a", owner=("StatefulSet", "flash-prefill", False)), owners) is None  # not its controller
    router = Router(RouterArgs(owners=owners))
    sync(router, {"p": pod("p", ip="10.0.0.5", owner=("StatefulSet", "flash-prefill")), "x": pod("x", ip="10.0.0.9")})
    assert set(router.pool.workers) == {"http://10.0.0.5:8100"}


def test_sync_keeps_static_workers_and_replaces_discovered_ones():
    router = Router(RouterArgs(decode=["http://127.0.0.1:1"], prefill=["http://127.0.0.1:2"]))
    sync(router, {"p": pod("p", ip="10.0.0.5"), "d": pod("d", role="decode", ip="10.0.0.6")})
    assert {u for u, w in router.pool.workers.items() if w.source == "kubernetes"} == {
        "http://10.0.0.5:8100",
        "http://10.0.0.6:8100",
    }
    sync(router, {"d": pod("d", role="decode", ip="10.0.0.6", draining=True)})
    assert set(router.pool.workers) == {"http://127.0.0.1:1", "http://127.0.0.1:2"}


async def test_watch_follows_pods_through_the_api(kube_client, kubeconfig, monkeypatch):
    # kubernetes_asyncio sends watch=True; the API server parses booleans like Go does
    # ("True" is true), kmock only knows "true": fill that gap on the emulator's side.
    from kmock._internal import parsing

    guess = parsing.guess_k8s
    monkeypatch.setattr(
        parsing,
        "guess_k8s",
        lambda k8s, method, query: guess(
            k8s, method, {**query, **({"watch": "true"} if str(query.get("watch", "")).lower() == "true" else {})}
        ),
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    router = Router(RouterArgs())

    async def no_check(w):  # the pods' IPs are not reachable from here; only membership is tested
        w.reason = "checked"

    router.health.check = no_check

    async def create(p):  # status is a subresource: the kubelet's part, written separately
        await kube_client.create(p, "pods")
        await kube_client.patch(
            "v1", "pods", "serving", p["metadata"]["name"], {"status": p["status"]}, subresource="status"
        )

    await create(pod("flash-prefill-0", ip="10.1.0.1"))
    await create(pod("other-prefill-0", ip="10.9.0.1", instance="other"))
    task = asyncio.create_task(watch_pods(router, "serving", "app.kubernetes.io/instance=flash"))
    try:
        await eventually(lambda: set(router.pool.workers) == {"http://10.1.0.1:8100"})
        await create(pod("flash-decode-0", role="decode", ip="10.1.0.2"))
        await eventually(lambda: "http://10.1.0.2:8100" in router.pool.workers)
        await kube_client.patch(
            "v1", "pods", "serving", "flash-prefill-0", {"metadata": {"labels": {"serving.dsv4.dev/draining": "true"}}}
        )
        await eventually(lambda: "http://10.1.0.1:8100" not in router.pool.workers)
        await kube_client.delete("v1", "pods", "serving", "flash-decode-0")
        await eventually(lambda: not router.pool.workers)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
