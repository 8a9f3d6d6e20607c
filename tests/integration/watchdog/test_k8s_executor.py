"""KubernetesExecutor step by step, over real HTTP to the emulated API server and to a scripted
engine (see conftest.ScriptedEngine), without kopf: what each step writes, and that a step
replayed after its pod was replaced never touches the replacement."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from watchdog_harness import NS, ClusterClient, ScriptedEngine, WatchdogCluster, deployment, owner_statefulset, pod_body
from dsv4_operator.kube import KubeApi, load_configuration
from dsv4_operator.remediation.executor import DeploymentContext, KubernetesExecutor
from dsv4_operator.watchdog.pods import DRAINING_LABEL, engine_pod
from dsv4_operator.telemetry import OperatorMetrics
from dsv4_operator.watchdog.detector import Wedged
from dsv4_operator.watchdog.policy import ABORT, CAPTURE_EVIDENCE, DRAIN, HELD, REPORT, RESTART, Action


class Harness:
    def __init__(self, api: KubeApi, client: ClusterClient, cr: dict, engine: ScriptedEngine, kind: str = "builtin"):
        self.api, self.client, self.engine = api, client, engine
        self.posted: list[tuple[str, str, str]] = []
        self.metrics = OperatorMetrics()
        self.ctx = DeploymentContext(
            NS,
            cr["metadata"]["name"],
            cr["metadata"]["uid"],
            kind=kind,
            spec_diff=["since stable revision abc (generation 1):", "decode.env FOO changed from 1 to 2"],
            revision="def",
        )
        self.executor = KubernetesExecutor(lambda: api, self.ctx, lambda *e: self.posted.append(e), self.metrics)

    async def refresh(self) -> None:
        pods = await self.client.list("v1", "pods", NS)
        self.ctx.pods = {p.name: p for p in (engine_pod(o) for o in pods) if p}

    def action(self, kind: str, pod: str = "flash-prefill-0", reason: str = "stuck_inflight", **kw: Any) -> Action:
        uid = kw.pop("uid", self.ctx.pods[pod].uid if pod in self.ctx.pods else None)
        return Action(kind, pod, "prefill", reason, uid=uid, attempt=1, **kw)


@pytest.fixture
async def harness(kube_cluster: WatchdogCluster, kube_client: ClusterClient, kubeconfig: Path, engines) -> Harness:
    cr = await kube_client.create(deployment("flash", remediation={}), "dsv4deployments")
    engine = await engines("prefill", "wedged")
    # With a sidecar: the evidence must ask pods/log for the engine container by name.
    owner = await owner_statefulset(kube_client, "flash", "prefill", own=True)
    await kube_client.create(
        pod_body("flash", "flash-prefill-0", "prefill", engine.port, sidecar=True, owner=owner), "pods"
    )
    await kube_client.patch(
        "v1",
        "pods",
        NS,
        "flash-prefill-0",
        {"status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}},
        subresource="status",
    )
    api = KubeApi(await load_configuration(str(kubeconfig)))
    h = Harness(api, kube_client, cr, engine)
    await h.refresh()
    yield h
    await h.executor.close()
    await api.close()


async def test_every_step_in_order(harness: Harness, kube_cluster: WatchdogCluster) -> None:
    h = harness
    verdict = Wedged("stuck_inflight", {"pending": 1.0, "stuck_seconds": 3.0})
    kube_cluster.pod_logs[(NS, "flash-prefill-0")] = lambda: "".join(f"line {i}\n" for i in range(500))

    assert await h.executor.run(h.action(REPORT, details={"pending": 1.0}), verdict) == (True, None)
    ok, note = await h.executor.run(h.action(CAPTURE_EVIDENCE), verdict)
    assert ok and note is None
    [cm] = [c for c in kube_cluster.objects_of("v1/configmaps", NS)]
    assert cm["metadata"]["labels"]["serving.dsv4.dev/evidence"] == "true"
    assert cm["metadata"]["ownerReferences"] == [h.ctx.owner_reference()]
    data = cm["data"]
    assert json.loads(data["verdict.json"])["reason"] == "stuck_inflight"
    assert json.loads(data["loads.json"])["queues"]["inflight"] == 1
    assert "dsv4:num_prefill_inflight_queue_reqs" in data["metrics.txt"]
    assert "scripted prefill engine" in data["stacks.txt"]
    assert data["logs.txt"].splitlines() == [f"line {i}" for i in range(300, 500)]  # the last 200 lines
    assert "decode.env FOO changed from 1 to 2" in data["spec-diff.txt"]
    assert h.executor.evidence["flash-prefill-0"] == cm["metadata"]["name"]

    assert await h.executor.run(h.action(DRAIN), verdict) == (True, None)
    pod = await h.client.get("v1", "pods", NS, "flash-prefill-0")
    assert pod["metadata"]["labels"][DRAINING_LABEL] == "true"
    assert await h.executor.run(h.action(ABORT), verdict) == (True, None)
    assert h.engine.admin_calls() == ["/debug/stacks", "/admin/drain", "/admin/abort"]
    assert await h.executor.run(h.action(RESTART), verdict) == (True, None)
    assert await h.client.get("v1", "pods", NS, "flash-prefill-0") is None
    assert kube_cluster.evictions == [("flash-prefill-0", 201)]  # through the Eviction API, not a bare DELETE
    assert ("create", "", "pods/eviction") in kube_cluster.recorder.observed()
    assert ("delete", "", "pods") not in kube_cluster.recorder.observed()

    assert [reason for _, reason, _ in h.posted] == [
        "WedgeDetected",
        "EvidenceCaptured",
        "Drained",
        "Aborted",
        "Restarted",
    ]
    assert h.posted[0][0] == "Warning" and "stuck_inflight" in h.posted[0][2]
    rendered = h.metrics.render().decode()
    assert 'dsv4_operator_wedges_detected_total{reason="stuck_inflight",role="prefill"} 1.0' in rendered
    for step in ("capture_evidence", "drain", "abort", "restart"):
        assert f'dsv4_operator_remediations_total{{action="{step}",result="ok",role="prefill"}} 1.0' in rendered


async def test_a_replayed_step_never_touches_the_replacement(harness: Harness) -> None:
    h = harness
    old = h.action(RESTART)  # judged on the first incarnation
    await h.client.delete("v1", "pods", NS, "flash-prefill-0")
    owner = await owner_statefulset(h.client, "flash", "prefill", own=True)
    await h.client.create(pod_body("flash", "flash-prefill-0", "prefill", h.engine.port, owner=owner), "pods")
    await h.refresh()
    new_uid = h.ctx.pods["flash-prefill-0"].uid
    assert new_uid != old.uid

    # Acting on what the executor knows is the old pod: it says so and leaves the new one alone.
    assert await h.executor.run(h.action(DRAIN, uid=old.uid), None) == (
        True,
        f"pod was replaced (uid {new_uid}, not {old.uid})",
    )
    # The API server is the last word: even with a stale view the label patch and the delete
    # carry the old UID as a precondition.
    h.ctx.pods["flash-prefill-0"] = dataclasses.replace(h.ctx.pods["flash-prefill-0"], uid=old.uid)
    ok, note = await h.executor.run(h.action(DRAIN, uid=old.uid), None)
    assert ok and note.startswith("not labelled: 422")
    assert await h.executor.run(old, None) == (True, "already replaced")
    pod = await h.client.get("v1", "pods", NS, "flash-prefill-0")
    assert pod["metadata"]["uid"] == new_uid and DRAINING_LABEL not in pod["metadata"]["labels"]
    assert h.engine.admin_calls() == []
    await h.client.delete("v1", "pods", NS, "flash-prefill-0")
    assert await h.executor.run(h.action(RESTART, uid=new_uid), None) == (True, "already gone")


async def test_an_eviction_a_pdb_blocks_is_held_and_retried(harness: Harness, kube_cluster: WatchdogCluster) -> None:
    """A PodDisruptionBudget that allows no disruption answers 429: the restart fails (so the policy
    keeps it pending and retries), an Event says so once, and when the budget allows it goes."""
    h = harness
    pdb = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "flash-prefill", "namespace": NS},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"serving.dsv4.dev/role": "prefill"}}},
    }
    await h.client.create(pdb, "poddisruptionbudgets")
    for _ in range(3):
        ok, note = await h.executor.run(h.action(RESTART), None)
        assert not ok and note.startswith("eviction blocked by a PodDisruptionBudget")
    assert await h.client.get("v1", "pods", NS, "flash-prefill-0") is not None
    assert [reason for _, reason, _ in h.posted] == ["EvictionBlocked"]
    assert kube_cluster.evictions == [("flash-prefill-0", 429)] * 3
    assert 'action="eviction_blocked"' in h.metrics.render().decode()
    await h.client.patch("policy/v1", "poddisruptionbudgets", NS, "flash-prefill", {"spec": {"minAvailable": 0}})
    assert await h.executor.run(h.action(RESTART), None) == (True, None)
    assert await h.client.get("v1", "pods", NS, "flash-prefill-0") is None
    assert kube_cluster.evictions[-1] == ("flash-prefill-0", 201)


async def test_an_eviction_the_api_server_throttles_is_not_blamed_on_a_budget(
    harness: Harness, kube_cluster: WatchdogCluster
) -> None:
    """API Priority and Fairness answers 429 too: that is load shedding, no PodDisruptionBudget
    (there is none here). The restart stays pending and says why; no EvictionBlocked Event."""
    h = harness
    kube_cluster.throttled = 1
    ok, note = await h.executor.run(h.action(RESTART), None)
    assert not ok and note.startswith("eviction throttled by the API server") and "PodDisruptionBudget" in note
    assert [reason for _, reason, _ in h.posted] == []
    assert 'action="eviction_throttled"' in h.metrics.render().decode()
    assert await h.executor.run(h.action(RESTART), None) == (True, None)  # the next round goes through


async def test_evidence_from_a_dead_engine_and_no_pod_logs(harness: Harness, kube_cluster: WatchdogCluster) -> None:
    """A dead engine answers nothing and the emulator serves no pod logs (it answers pods/log with
    the Pod): the evidence says what is missing, and the step still counts as done."""
    h = harness
    await h.engine.stop()
    ok, note = await h.executor.run(h.action(CAPTURE_EVIDENCE, details={"pending": 1.0}), None)
    assert ok and "stacks" in note and "logs (the API server serves no pod logs)" in note
    [cm] = kube_cluster.objects_of("v1/configmaps", NS)
    assert cm["data"]["logs.txt"].startswith("(pod logs unavailable")
    assert cm["data"]["stacks.txt"].startswith("(not captured")
    verdict = json.loads(cm["data"]["verdict.json"])
    assert verdict == {"state": "Wedged", "reason": "stuck_inflight", "details": {"pending": 1.0}, "resumed": True}
    ok, note = await h.executor.run(h.action(ABORT), None)
    assert ok and note.startswith("abort: ")  # best effort: the restart still follows


async def test_sglang_engines_are_aborted_their_way(
    kube_cluster: WatchdogCluster, kube_client: ClusterClient, kubeconfig: Path, engines
) -> None:
    cr = await kube_client.create(deployment("sgl", remediation={}), "dsv4deployments")
    engine = await engines("prefill", "wedged")
    owner = await owner_statefulset(kube_client, "sgl", "prefill", own=True)
    await kube_client.create(pod_body("sgl", "flash-prefill-0", "prefill", engine.port, owner=owner), "pods")
    await kube_client.patch(
        "v1", "pods", NS, "flash-prefill-0", {"status": {"podIP": "127.0.0.1"}}, subresource="status"
    )
    api = KubeApi(await load_configuration(str(kubeconfig)))
    try:
        h = Harness(api, kube_client, cr, engine, kind="sglang")
        await h.refresh()
        assert (await h.executor.run(h.action(DRAIN), None))[0]
        await h.executor.run(h.action(ABORT), None)
        assert engine.admin_calls() == ["/abort_request"]  # SGLang has no /admin/drain
        await h.executor.run(
            h.action(HELD, reason="budget", details={"max_unavailable": 1, "unavailable": ["flash-prefill-1"]}), None
        )
        assert h.posted[-1][1] == "RemediationHeld" and "maxUnavailable.prefill is 1" in h.posted[-1][2]
        await h.executor.close()
    finally:
        await api.close()


async def test_only_the_newest_evidence_is_kept(harness: Harness, kube_cluster: WatchdogCluster) -> None:
    h = harness
    clock = iter(range(1_800_000_000, 1_800_000_100, 7))
    h.executor.evidence_kept, h.executor.clock = 2, lambda: float(next(clock))
    for pod in ("flash-prefill-0", "flash-prefill-1", "flash-prefill-2"):
        h.ctx.pods[pod] = dataclasses.replace(h.ctx.pods["flash-prefill-0"], name=pod)
        assert (await h.executor.run(h.action(CAPTURE_EVIDENCE, pod), None))[0]
    kept = sorted(c["metadata"]["labels"]["serving.dsv4.dev/pod"] for c in kube_cluster.objects_of("v1/configmaps", NS))
    assert kept == ["flash-prefill-1", "flash-prefill-2"]
    assert {("list", "", "configmaps"), ("delete", "", "configmaps")} <= kube_cluster.recorder.observed()
