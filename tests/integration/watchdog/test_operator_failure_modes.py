"""The operator under real-cluster failure modes, over HTTP against the emulated API server with
the real operator (kopf + watchdog): engines it cannot reach while the kubelet reports them Ready
are never restarted (and it says why); a pod wedged on its own metrics among them still is; two
operator replicas elect one leader on a Lease and one wedge is remediated once."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from bench.harness.kmock_cluster import ClusterClient, eventually
from bench.harness.operator_runner import OperatorThread, free_port
from test_watchdog_operator import DETECT, INTERVAL, WINDOW, start_deployment, watching
from watchdog_harness import NS, WatchdogCluster, condition, events, get_cr, operator_calls

from dsv4_operator.kube import KubeApi, load_configuration
from dsv4_operator.leader import LeaderElection, LeaderElector

FOUR = {
    "flash-prefill-0": "healthy",
    "flash-prefill-1": "healthy",
    "flash-decode-0": "healthy",
    "flash-decode-1": "healthy",
}


async def test_ready_but_unreachable_pods_are_never_restarted_and_the_operator_says_why(
    kube_cluster: WatchdogCluster, kube_client: ClusterClient, pod_farm, engines, operator_factory
) -> None:
    """A partition between the operator and every engine (the kubelet still reports them Ready):
    many detection windows pass and nothing is evicted; an OperatorBlind Event and the Wedged
    condition (Unknown, OperatorBlind) say it is the operator's own network."""
    await operator_factory()
    farm = pod_farm("flash")
    _, backends = await start_deployment(kube_client, farm, engines, "flash", dict(FOUR))
    await eventually(lambda: watching(kube_client, "flash", 4), timeout=10)
    for backend in backends.values():
        await backend.stop()  # the operator's packets go nowhere; the pods stay Ready

    async def blind() -> bool:
        cond = condition(await get_cr(kube_client, "flash"))
        return cond.get("status") == "Unknown" and cond.get("reason") == "OperatorBlind"

    await eventually(blind, timeout=DETECT)
    await asyncio.sleep(4 * WINDOW)  # many windows more: still nothing

    assert not kube_cluster.evictions and not kube_cluster.removed_pods()
    assert not operator_calls(kube_cluster, "create", "pods/eviction")
    assert not operator_calls(kube_cluster, "patch", "pods")  # not even drained
    [said] = events(kube_cluster, "flash", "OperatorBlind")
    assert "cannot reach 4 of 4 engine pods the kubelet reports Ready" in said["message"]
    assert not events(kube_cluster, "flash", "WedgeDetected")
    held = events(kube_cluster, "flash", "RemediationHeld")
    assert len(held) == 4 and all("went silent together" in e["message"] for e in held)  # once per pod
    cr = await get_cr(kube_client, "flash")
    assert "operator's own network" in condition(cr)["message"] and cr["status"]["wedgedPods"] == 0
    # Dozens of rounds, and the pods came from one watch (kopf's index), not a LIST per round.
    assert len(operator_calls(kube_cluster, "list", "pods")) <= 2
    assert operator_calls(kube_cluster, "watch", "pods")


async def test_a_wedged_pod_among_unreachable_ones_is_still_remediated(
    kube_cluster: WatchdogCluster, kube_client: ClusterClient, pod_farm, engines, operator_factory
) -> None:
    await operator_factory()
    farm = pod_farm("flash")
    farm.recreate_after = 0.2
    _, backends = await start_deployment(kube_client, farm, engines, "flash", dict(FOUR))
    await eventually(lambda: watching(kube_client, "flash", 4), timeout=10)
    for pod in ("flash-prefill-1", "flash-decode-0", "flash-decode-1"):
        await backends[pod].stop()
    backends["flash-prefill-0"].set_mode("wedged")  # answers: its own metrics show the hand-off stuck

    await eventually(lambda: kube_cluster.evictions, timeout=DETECT + WINDOW)
    await asyncio.sleep(2 * WINDOW)
    assert kube_cluster.evictions == [("flash-prefill-0", 201)]
    assert [o["metadata"]["name"] for _, o in kube_cluster.removed_pods()] == ["flash-prefill-0"]
    [wedge] = events(kube_cluster, "flash", "WedgeDetected")
    assert wedge["message"].startswith("flash-prefill-0 (prefill) wedged: stuck_inflight")
    held = {e["message"].split(" ")[0] for e in events(kube_cluster, "flash", "RemediationHeld")}
    assert held == {"flash-prefill-1", "flash-decode-0", "flash-decode-1"}
    assert events(kube_cluster, "flash", "OperatorBlind")


async def test_one_silent_ready_pod_waits_for_the_kubelet_to_agree(
    kube_cluster: WatchdogCluster, kube_client: ClusterClient, pod_farm, engines, operator_factory
) -> None:
    await operator_factory()
    farm = pod_farm("flash")
    _, backends = await start_deployment(kube_client, farm, engines, "flash", dict(FOUR))
    await eventually(lambda: watching(kube_client, "flash", 4), timeout=10)
    await backends["flash-decode-1"].stop()

    await eventually(lambda: events(kube_cluster, "flash", "RemediationHeld"), timeout=DETECT)
    await asyncio.sleep(2 * WINDOW)
    assert not kube_cluster.evictions
    [held] = events(kube_cluster, "flash", "RemediationHeld")
    assert "kubelet reports it Ready" in held["message"]
    assert not events(kube_cluster, "flash", "OperatorBlind")  # one pod is no partition
    cond = condition(await get_cr(kube_client, "flash"))
    assert cond["status"] == "False" and "not restarted on silence alone" in cond["message"]

    # The kubelet's probe fails too: now the cluster agrees, and the pod is restarted.
    await kube_client.patch(
        "v1",
        "pods",
        NS,
        "flash-decode-1",
        {"status": {"conditions": [{"type": "Ready", "status": "False"}]}},
        subresource="status",
    )
    await eventually(lambda: kube_cluster.evictions, timeout=DETECT)
    assert kube_cluster.evictions == [("flash-decode-1", 201)]


async def test_two_electors_one_leader_and_a_partitioned_leader_stops_first(
    kube_cluster: WatchdogCluster, kubeconfig: Path
) -> None:
    cfg = LeaderElection(namespace=NS, lease_s=1.5, renew_deadline_s=1.0, retry_s=0.2)
    apis = [KubeApi(await load_configuration(str(kubeconfig))) for _ in range(2)]
    try:
        a = LeaderElector(lambda: apis[0], LeaderElection(**{**cfg.__dict__, "identity": "a"}))
        b = LeaderElector(lambda: apis[1], LeaderElection(**{**cfg.__dict__, "identity": "b"}))
        assert await a.try_once() and a.is_leader()
        assert not await b.try_once() and not b.is_leader()
        # a is cut off (renews nothing): it stops counting itself leader at its renew deadline,
        # before b, judging on its own clock, may take the Lease at the lease duration.
        cut_at = time.monotonic()
        await eventually(lambda: not a.is_leader(), timeout=3, interval=0.02)
        a_stopped = time.monotonic()
        assert await b.acquire(lambda: time.monotonic() - cut_at > 5)
        b_took = time.monotonic()
        assert a_stopped < b_took and b_took - cut_at >= cfg.lease_s * 0.9
        assert not await a.try_once()  # back from the partition: b holds it now
        lease = await apis[0].request("GET", f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/dsv4-operator")
        assert lease["spec"]["holderIdentity"] == "b" and lease["spec"]["leaseTransitions"] == 1
        await b.release()  # a clean stop hands over at once
        assert await a.try_once()
    finally:
        for api in apis:
            await api.close()


async def test_two_operators_one_wedge_one_remediation(
    kube_cluster: WatchdogCluster, kube_client: ClusterClient, kubeconfig: Path, pod_farm, engines
) -> None:
    election = LeaderElection(namespace=NS, lease_s=8.0, renew_deadline_s=6.0, retry_s=0.3)  # roomy: a busy CI
    ops = [OperatorThread(kubeconfig, [NS], free_port(), leader_election=election) for _ in range(2)]
    try:
        await ops[0].start()  # leads: kopf runs
        await ops[1].start(wait_ready=False)
        await eventually(lambda: ops[1].state.standby, timeout=10)
        farm = pod_farm("flash")
        farm.recreate_after = 0.2
        _, backends = await start_deployment(
            kube_client, farm, engines, "flash", {"flash-prefill-0": "healthy", "flash-decode-0": "healthy"}
        )
        await eventually(lambda: watching(kube_client, "flash", 2), timeout=10)
        backends["flash-prefill-0"].set_mode("wedged")
        await eventually(lambda: events(kube_cluster, "flash", "Restarted"), timeout=DETECT)
        await asyncio.sleep(6 * INTERVAL)

        assert kube_cluster.evictions == [("flash-prefill-0", 201)]
        assert len(events(kube_cluster, "flash", "WedgeDetected")) == 1
        assert len(events(kube_cluster, "flash", "Applied")) == 1  # one reconciler too
        assert ops[1].state.standby and not ops[1].ready_flag.is_set()  # the standby never acted
        assert not ops[0].state.standby and ops[0].ready_flag.is_set()

        # The leader stops cleanly: the standby takes over at once and heals the next wedge, once.
        await ops[0].stop()
        await eventually(lambda: ops[1].ready_flag.is_set(), timeout=10)
        backends["flash-decode-0"].set_mode("wedged")
        await eventually(lambda: len(kube_cluster.evictions) == 2, timeout=DETECT + 2 * WINDOW)
        await asyncio.sleep(4 * INTERVAL)
        assert kube_cluster.evictions == [("flash-prefill-0", 201), ("flash-decode-0", 201)]
    finally:
        for op in ops:
            if op.thread.is_alive():
                await op.stop()
