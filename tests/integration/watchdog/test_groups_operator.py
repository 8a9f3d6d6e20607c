"""Multi-node engines (nodesPerReplica: 2) under the real operator, on the strict emulator.

- The StatefulSet pair: the operator makes each group's worker StatefulSet from its leader pod;
  deleting one worker pod makes the whole group anew exactly once (the leader deleted, its
  workers with it); the router (real discovery, real health checks) drops the group at the pod
  event, well within two health checks, and never routes to it while it is not whole.
- A wedge in a worker rank (its heartbeat stopped) is one remediation of the group: evidence from
  every pod, the leader drained and aborted, one eviction, the group made anew.
- LeaderWorkerSet installed (its released CRD, trimmed, served by the emulator with validation and
  pruning): the role is one LeaderWorkerSet that the API server keeps whole, the operator leaves its
  groups to LWS, and going back to one node replaces the LWS by a StatefulSet.
Every call the operator made is one the chart grants.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: chart_testutil

from chart_testutil import grants, helm_template, rbac_rules
from group_harness import GroupFarm, uid_of, until
from bench.harness.kmock_cluster import ClusterClient
from watchdog_harness import API, NS, PLURAL, WatchdogCluster, events, evidence_maps, get_cr, operator_calls

from dsv4_operator import workload_form
from dsv4_operator.manifests import contains

LWS_CRD = Path(__file__).resolve().parents[2] / "fixtures" / "lws" / "leaderworkersets-v0.10.0.yaml"
HEALTH_INTERVAL = 0.5


def group_deployment(name: str, **remediation) -> dict:
    return {
        "apiVersion": API,
        "kind": "DSV4Deployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "model": {"name": "m", "path": "/models/m"},
            "engine": {"image": "reg/dsv4:1"},
            "decode": {"nodesPerReplica": 2, "gpusPerPod": 8},
            "remediation": {
                "scrapeIntervalSeconds": 0.5,
                "detectionWindowSeconds": 2,
                "cooldownSeconds": 0,
                **remediation,
            },
        },
    }


def granted_by_chart(cluster: WatchdogCluster) -> None:
    docs = helm_template({"watch.scope": "cluster"})
    granted = grants(rbac_rules(docs))
    missing = sorted(c for c in cluster.recorder.observed() if (c[1], c[2], c[0]) not in granted)
    assert not missing, f"the operator called what the chart does not grant: {missing}"


@pytest.fixture
def kube_discovery(monkeypatch, kubeconfig):
    """The router's discovery client against the emulator (see test_router_discovery)."""
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


async def formed(client: ClusterClient, farm: GroupFarm, leader: str = "flash-decode-0") -> dict:
    """The group's leader, once its worker is there and the watchdog reports the group ready."""
    await until(lambda: f"{leader}-1" in farm.pods() and leader in farm.pods(), timeout=20)

    async def ready() -> bool:
        groups = ((await get_cr(client, "flash")) or {}).get("status", {}).get("groups") or []
        return any(g["name"] == leader and g["ready"] and g["nodes"] == "2/2" for g in groups)

    await until(ready, timeout=20)
    return farm.pods()[leader]


async def test_a_group_restarts_once_whether_a_worker_pod_goes_or_a_worker_rank_wedges(
    kube_cluster: WatchdogCluster, kube_client: ClusterClient, operator_factory, kube_discovery
) -> None:
    """One operator, one group, two faults. (1) A worker pod deleted: the group is made anew exactly
    once, and the router (real discovery and health checks, in this process) drops the group at
    the pod event, within two health checks, and does not route to it again until it is whole.
    (2) Then a rank of the new worker freezes: one remediation of the group, evidence from every
    pod, the leader drained and aborted, one eviction (of the leader), the group made anew again
    (by the eviction: no second recreation by the group controller)."""
    from dsv4_router.router import Router, RouterArgs

    await operator_factory()
    farm = GroupFarm(kube_client, kube_cluster, "flash").start()
    router = Router(
        RouterArgs(
            discover_namespace=NS,
            selector="app.kubernetes.io/instance=flash",
            owners=["flash-prefill", "flash-decode"],
            health_interval=HEALTH_INTERVAL,
        )
    )
    try:
        await kube_client.create(group_deployment("flash"), PLURAL)
        leader = await formed(kube_client, farm)
        workers_sts = await kube_client.get("apps/v1", "statefulsets", NS, "flash-decode-0")
        assert workers_sts["spec"]["replicas"] == 1 and workers_sts["metadata"]["ownerReferences"][0]["uid"] == uid_of(
            leader
        )
        url = f"http://127.0.0.1:{farm.backends['flash-decode-0'].port}"
        rounds: list[float] = []  # when each of the router's health-check rounds ended
        check_all = router.health.check_all

        async def counted() -> None:
            await check_all()
            rounds.append(time.monotonic())

        router.health.check_all = counted  # type: ignore[method-assign]
        await router.start()
        await until(lambda: url in router.pool.workers and router.pool.workers[url].healthy, timeout=10)

        # (1) A worker pod deleted.
        samples: list[tuple[float, bool]] = []

        async def watch_router() -> None:
            while True:
                w = router.pool.workers.get(url)
                samples.append((time.monotonic(), w is not None and w.healthy))
                await asyncio.sleep(0.01)

        sampler = asyncio.create_task(watch_router())
        worker = farm.pods()["flash-decode-0-1"]
        deleted_at = time.monotonic()
        await kube_client.delete("v1", "pods", NS, "flash-decode-0-1")
        new_leader = await until(
            lambda: (p := farm.pods().get("flash-decode-0")) and uid_of(p) != uid_of(leader) and p, timeout=15
        )
        new_worker = await until(
            lambda: (p := farm.pods().get("flash-decode-0-1")) and uid_of(p) != uid_of(worker) and p, timeout=15
        )
        assert new_worker["metadata"]["ownerReferences"][0]["uid"] != workers_sts["metadata"]["uid"]
        await until(lambda: url in router.pool.workers and router.pool.workers[url].healthy, timeout=10)
        whole_at = farm.ready_at("flash-decode-0-1", deleted_at)  # the new worker Running and Ready
        await asyncio.sleep(3.0)  # time for a second recreation, if there were one
        sampler.cancel()

        recreated = events(kube_cluster, "flash", "GroupRecreated")
        assert len(recreated) == 1, [e["message"] for e in recreated]
        assert "worker flash-decode-0-1 (node 1) was deleted" in recreated[0]["message"]
        assert len(operator_calls(kube_cluster, "delete", "pods")) == 1
        assert uid_of(farm.pods()["flash-decode-0"]) == uid_of(new_leader), "the group was made anew once"
        left = next(t for t, routed in samples if t > deleted_at and not routed)
        checks = [t for t in rounds if deleted_at < t < left]
        assert len(checks) <= 2, f"still routed after {len(checks)} health checks ({left - deleted_at:.2f} s)"
        assert whole_at is not None
        half = [t for t, routed in samples if left <= t < whole_at and routed]
        assert not half, f"routed to a half group {len(half)} times"
        print(
            f"router dropped the group {left - deleted_at:.3f} s after the worker pod was deleted "
            f"({len(checks)} health checks in between)"
        )

        # (2) A rank of the (new) worker node freezes.
        await formed(kube_client, farm)
        farm.backends["flash-decode-0-1"].stop_rank()
        stopped_at = time.monotonic()
        await until(lambda: (p := farm.pods().get("flash-decode-0")) and uid_of(p) != uid_of(new_leader), timeout=20)
        took = time.monotonic() - stopped_at
        await formed(kube_client, farm)
        await asyncio.sleep(1.0)

        assert kube_cluster.evictions == [("flash-decode-0", 201)]  # one restart, of the group by its leader
        maps = {m["metadata"]["annotations"]["serving.dsv4.dev/pod"]: m for m in evidence_maps(kube_cluster)}
        assert set(maps) == {"flash-decode-0", "flash-decode-0-1"}, set(maps)
        worker_map = maps["flash-decode-0-1"]
        assert "rank 1 (pid 4242)" in worker_map["data"]["stacks.txt"] and "stopped" in worker_map["data"]["stacks.txt"]
        assert '"group": "flash-decode-0"' in worker_map["data"]["verdict.json"]
        assert "rank_stalled" in maps["flash-decode-0"]["data"]["verdict.json"]
        leader_calls = farm.backends["flash-decode-0"].admin_calls()
        assert "/admin/drain" in leader_calls and "/admin/abort" in leader_calls
        assert len(events(kube_cluster, "flash", "GroupRecreated")) == 1, "the watchdog's restart is the only one"
        wedged = events(kube_cluster, "flash", "WedgeDetected")
        assert len(wedged) == 1 and "flash-decode-0" in wedged[0]["message"]
        print(f"group restarted {took:.2f} s after its worker's rank stopped (window 2 s)")
        granted_by_chart(kube_cluster)
    finally:
        await router.stop()
        await farm.stop()


async def test_with_leaderworkerset_installed_the_role_is_one_lws_the_api_server_keeps_whole(
    kube_cluster: WatchdogCluster, kube_client: ClusterClient, operator_factory
) -> None:
    kube_cluster.register_crd(yaml.safe_load(LWS_CRD.read_text()))  # validating and pruning, as released
    workload_form.forget()
    await operator_factory()
    body = group_deployment("flash", enabled=False)
    body["spec"]["rollout"] = {"canary": {"enabled": False}}  # the change below rolls at once (no probe to wait on)
    await kube_client.create(body, PLURAL)

    lws = await until(lambda: kube_client.get("leaderworkerset.x-k8s.io/v1", "leaderworkersets", NS, "flash-decode"))
    from dsv4_operator.manifests import Owner, build_children
    from dsv4_operator.spec import parse_spec

    cr = await get_cr(kube_client, "flash")
    wanted = next(
        c
        for c in build_children(parse_spec(cr["spec"]), Owner("flash", NS, cr["metadata"]["uid"]), lws=True)
        if c["kind"] == "LeaderWorkerSet"
    )
    assert contains(lws, wanted), "the API server pruned or changed what the operator applied"
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2 and lws["spec"]["startupPolicy"] == "LeaderCreated"
    assert await kube_client.get("apps/v1", "statefulsets", NS, "flash-decode") is None  # LWS makes its own
    assert await kube_client.get("apps/v1", "statefulsets", NS, "flash-prefill") is not None

    # A pod of an LWS group: its recreation is LWS's, the operator leaves it alone.
    lws_pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "flash-decode-0-1",
            "namespace": NS,
            "labels": {
                "app.kubernetes.io/name": "dsv4",
                "app.kubernetes.io/instance": "flash",
                "serving.dsv4.dev/role": "decode",
                "serving.dsv4.dev/group-size": "2",
                "leaderworkerset.sigs.k8s.io/name": "flash-decode",
            },
        },
        "spec": {"containers": [{"name": "engine", "image": "reg/dsv4:1"}]},
    }
    await kube_client.create(lws_pod, "pods")
    await kube_client.delete("v1", "pods", NS, "flash-decode-0-1")
    await asyncio.sleep(1.0)
    assert not operator_calls(kube_cluster, "delete", "pods") and not events(kube_cluster, "flash", "GroupRecreated")

    # Back to one node per replica: the LWS goes first, then the operator's StatefulSet.
    await kube_client.patch(API, PLURAL, NS, "flash", {"spec": {"decode": {"nodesPerReplica": 1}}})
    sts = await until(lambda: kube_client.get("apps/v1", "statefulsets", NS, "flash-decode"), timeout=15)
    assert "--nnodes" not in sts["spec"]["template"]["spec"]["containers"][0]["command"]
    assert await kube_client.get("leaderworkerset.x-k8s.io/v1", "leaderworkersets", NS, "flash-decode") is None
    granted_by_chart(kube_cluster)
    await kube_client.delete(API, PLURAL, NS, "flash")  # its daemons end with it, not at the operator's stop

    async def gone() -> bool:
        return await kube_client.get(API, PLURAL, NS, "flash") is None

    await until(gone, timeout=15)
