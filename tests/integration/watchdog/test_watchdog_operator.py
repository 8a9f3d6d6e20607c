"""The wedge watchdog inside the real operator (kopf over HTTP against the emulated API server).

The engine pods here are served by scripted engines (watchdog_harness.ScriptedEngine: /metrics
and /v1/loads of a state the test sets, and the admin endpoints), which stand in for many engine
states cheaply; the real engine's wedge, end to end, is test_watchdog_real_engines.py. The tests
stand in for the StatefulSet controller too (watchdog_harness.PodFarm recreates deleted pods).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Optional

import httpx

from bench.harness.kmock_cluster import ClusterClient, eventually
from watchdog_harness import (
    API,
    NS,
    PLURAL,
    PodFarm,
    ScriptedEngine,
    WatchdogCluster,
    condition,
    deployment,
    events,
    evidence_maps,
    get_cr,
    operator_calls,
)
from dsv4_operator.remediation.daemon import REVISIONS_ANNOTATION
from dsv4_operator.watchdog.pods import DRAINING_LABEL
from dsv4_operator.watchdog.policy import STATE_ANNOTATION
from dsv4_wire import ANNOTATION_PINNED_REVISION

WINDOW, INTERVAL = 2.0, 0.5
DETECT = WINDOW + 6 * INTERVAL + 2.0  # a wedge is acted on within this (window + rounds + a busy machine)


async def start_deployment(
    client: ClusterClient,
    farm: PodFarm,
    engines,
    name: str,
    pods: dict[str, str],
    *,
    remediation: Optional[dict] = None,
    decode_env: Optional[list] = None,
) -> tuple[dict, dict[str, ScriptedEngine]]:
    """The resource and its pods: {pod name: initial engine mode}."""
    cr = await client.create(deployment(name, remediation=remediation or {}, decode_env=decode_env), PLURAL)
    backends = {}
    for pod, mode in pods.items():
        role = "prefill" if "-prefill-" in pod else "decode"
        backends[pod] = await engines(role, mode)
        await farm.add(pod, role, backends[pod].port)
    return cr, backends


async def watching(client: ClusterClient, name: str, pods: int) -> Optional[dict]:
    cr = await get_cr(client, name)
    cond = condition(cr)
    return cr if cond.get("reason") == "NoWedge" and cond["message"].startswith(f"{pods} engine pods") else None


def remediation_state(cr: dict) -> dict:
    return json.loads(cr["metadata"].get("annotations", {}).get(STATE_ANNOTATION) or "{}")


async def test_a_long_prefill_and_a_busy_decode_are_never_touched(
    kube_cluster: WatchdogCluster, kube_client: ClusterClient, pod_farm, engines, operator_factory
) -> None:
    await operator_factory()
    farm = pod_farm("flash")
    _, backends = await start_deployment(
        kube_client, farm, engines, "flash", {"flash-prefill-0": "long_prefill", "flash-decode-0": "busy_decode"}
    )
    await eventually(lambda: watching(kube_client, "flash", 2), timeout=10)
    scrapes = {pod: b.scrapes for pod, b in backends.items()}
    await asyncio.sleep(2.5 * WINDOW)

    cr = await get_cr(kube_client, "flash")
    assert condition(cr)["status"] == "False", condition(cr)
    prefill = backends["flash-prefill-0"].loads()
    assert prefill["queues"]["running"] == 1 and prefill["queues"]["inflight"] == 0
    assert prefill["counters"]["prompt_tokens"] > 0 and prefill["counters"]["kv_transfers_completed"] == 0
    for pod, b in backends.items():
        assert b.scrapes - scrapes[pod] >= 2.5 * WINDOW / INTERVAL - 3, "it kept looking"
        assert b.admin_calls() == [], pod
    assert not evidence_maps(kube_cluster) and not kube_cluster.removed_pods()
    assert not operator_calls(kube_cluster, "patch", "pods") and not operator_calls(
        kube_cluster, "create", "pods/eviction"
    )
    assert not events(kube_cluster, "flash", "WedgeDetected") and not events(kube_cluster, "flash", "RemediationHeld")
    assert cr["status"]["wedgedPods"] == 0


async def test_two_wedged_pods_of_a_role_are_remediated_one_at_a_time(
    kube_cluster: WatchdogCluster, kube_client: ClusterClient, pod_farm, engines, operator_factory
) -> None:
    op = await operator_factory()
    farm = pod_farm("flash")
    farm.recreate_after = 0.5
    _, backends = await start_deployment(
        kube_client,
        farm,
        engines,
        "flash",
        {"flash-prefill-0": "healthy", "flash-prefill-1": "healthy", "flash-decode-0": "healthy"},
        remediation={"maxUnavailable": {"prefill": 1, "decode": 1}},
    )
    farm.on_recreate = lambda pod: backends[pod].reset("healthy")  # a new pod is a new, healthy engine
    await eventually(lambda: watching(kube_client, "flash", 3), timeout=10)
    for pod in ("flash-prefill-0", "flash-prefill-1"):
        backends[pod].set_mode("wedged")
    wedged_at = time.monotonic()

    def deleted() -> list[str]:
        return [pod for _, what, pod in farm.timeline if what == "deleted"]

    await eventually(lambda: deleted() == ["flash-prefill-0"], timeout=DETECT)
    held = await eventually(lambda: events(kube_cluster, "flash", "RemediationHeld"), timeout=5)
    assert "flash-prefill-1" in held[0]["message"] and "maxUnavailable.prefill is 1" in held[0]["message"]
    await eventually(lambda: deleted() == ["flash-prefill-0", "flash-prefill-1"], timeout=DETECT)

    # One at a time: the second pod was touched only once the first was back as a new, Ready pod.
    times = {(what, pod): t for t, what, pod in farm.timeline}
    back = max(t for t, what, pod in farm.timeline if (what, pod) == ("ready", "flash-prefill-0"))
    first_touch = min(t for t, _, _ in backends["flash-prefill-1"].calls)
    assert times[("deleted", "flash-prefill-0")] < back <= first_touch < times[("deleted", "flash-prefill-1")]
    assert times[("deleted", "flash-prefill-0")] - wedged_at < DETECT
    for pod in ("flash-prefill-0", "flash-prefill-1"):
        assert backends[pod].admin_calls() == ["/debug/stacks", "/admin/drain", "/admin/abort"], pod
    assert backends["flash-decode-0"].admin_calls() == []

    # Both back: the condition clears, the status keeps the record.
    async def healed() -> Optional[dict]:
        cr = await get_cr(kube_client, "flash")
        return cr if condition(cr).get("status") == "False" and cr["status"].get("remediationsTotal") == 2 else None

    cr = await eventually(healed, timeout=DETECT)
    assert cr["status"]["wedgedPods"] == 0
    last = cr["status"]["lastRemediation"]
    assert (last["pod"], last["action"], last["reason"], last["dryRun"]) == (
        "flash-prefill-1",
        "restart",
        "stuck_inflight",
        False,
    )
    assert len(evidence_maps(kube_cluster)) == 2
    for reason in ("WedgeDetected", "EvidenceCaptured", "Drained", "Restarted"):
        found = events(kube_cluster, "flash", reason)
        assert sorted(e["message"].split(" ")[0] for e in found) == ["flash-prefill-0", "flash-prefill-1"], reason
    state = remediation_state(cr)
    assert state["active"] == {} and state["history"]["flash-prefill-0"]["last_result"] == "restarted"
    # Writing its bookkeeping annotations never made the reconciler re-apply the children.
    assert len(events(kube_cluster, "flash", "Applied")) == 1

    async with httpx.AsyncClient() as http:
        metrics = (await http.get(f"http://127.0.0.1:{op.health_port}/metrics")).text
    assert 'dsv4_operator_wedges_detected_total{reason="stuck_inflight",role="prefill"} 2.0' in metrics
    assert 'dsv4_operator_remediations_total{action="restart",result="ok",role="prefill"} 2.0' in metrics
    assert 'dsv4_operator_remediations_total{action="held",result="budget",role="prefill"} 1.0' in metrics
    assert 'dsv4_operator_wedged_pods{deployment="flash",namespace="serving"} 0.0' in metrics
    assert "dsv4_operator_scrape_duration_seconds_count" in metrics

    # What the watchdog called, for the Helm chart's RBAC.
    assert {
        ("list", "", "pods"),
        ("watch", "", "pods"),
        ("patch", "", "pods"),
        ("create", "", "pods/eviction"),
        ("get", "", "pods/log"),
        ("create", "", "configmaps"),
        ("create", "", "events"),
        ("get", "serving.dsv4.dev", "dsv4deployments"),
        ("patch", "serving.dsv4.dev", "dsv4deployments"),
        ("patch", "serving.dsv4.dev", "dsv4deployments/status"),
    } <= kube_cluster.recorder.observed()
    assert ("delete", "", "pods") not in kube_cluster.recorder.observed()  # evictions only


async def test_an_operator_restart_mid_remediation_does_not_act_twice(
    kube_cluster: WatchdogCluster, kube_client: ClusterClient, pod_farm, engines, operator_factory
) -> None:
    first = await operator_factory()
    farm = pod_farm("flash")
    _, backends = await start_deployment(
        kube_client, farm, engines, "flash", {"flash-prefill-0": "healthy", "flash-decode-0": "healthy"}
    )
    engine = backends["flash-prefill-0"]
    engine.abort_gate = asyncio.Event()  # the abort hangs: the operator stops in the middle of it
    await eventually(lambda: watching(kube_client, "flash", 2), timeout=10)
    engine.set_mode("wedged")
    await asyncio.wait_for(engine.abort_started.wait(), DETECT)
    await operator_factory.stop(first)

    cr = await get_cr(kube_client, "flash")
    record = remediation_state(cr)["active"]["flash-prefill-0"]
    assert record["steps_done"] == ["capture_evidence", "drain"]  # stored after each step
    assert (await farm.get("flash-prefill-0"))["metadata"]["labels"][DRAINING_LABEL] == "true"
    assert len(evidence_maps(kube_cluster)) == 1 and not kube_cluster.removed_pods()

    engine.abort_gate.set()
    await operator_factory()  # a new operator picks the remediation up where it stopped
    await eventually(lambda: kube_cluster.removed_pods(), timeout=10)
    await eventually(lambda: events(kube_cluster, "flash", "Restarted"), timeout=5)
    await asyncio.sleep(4 * INTERVAL)

    assert len(kube_cluster.removed_pods()) == 1 and len(operator_calls(kube_cluster, "create", "pods/eviction")) == 1
    assert not operator_calls(kube_cluster, "delete", "pods")  # evicted, never a bare DELETE
    assert len(evidence_maps(kube_cluster)) == 1
    assert len(operator_calls(kube_cluster, "patch", "pods")) == 1  # the draining label, once
    assert engine.admin_calls() == ["/debug/stacks", "/admin/drain", "/admin/abort", "/admin/abort"]
    for reason in ("WedgeDetected", "EvidenceCaptured", "Drained", "Restarted"):
        assert len(events(kube_cluster, "flash", reason)) == 1, reason


async def test_dry_run_reports_and_acts_on_nothing(
    kube_cluster: WatchdogCluster, kube_client: ClusterClient, pod_farm, engines, operator_factory
) -> None:
    await operator_factory()
    farm = pod_farm("flash")
    _, backends = await start_deployment(
        kube_client,
        farm,
        engines,
        "flash",
        {"flash-prefill-0": "healthy", "flash-decode-0": "healthy"},
        remediation={"dryRun": True},
    )
    await eventually(lambda: watching(kube_client, "flash", 2), timeout=10)
    backends["flash-prefill-0"].set_mode("wedged")

    [report] = await eventually(lambda: events(kube_cluster, "flash", "WedgeDetected"), timeout=DETECT)
    assert report["type"] == "Warning" and "stuck_inflight" in report["message"] and "dry run" in report["message"]
    await asyncio.sleep(2 * WINDOW)

    cr = await get_cr(kube_client, "flash")
    cond = condition(cr)
    assert cond["status"] == "True" and "flash-prefill-0 (stuck_inflight)" in cond["message"]
    assert "dry run: nothing was done" in cond["message"]
    last = cr["status"]["lastRemediation"]
    assert (last["pod"], last["action"], last["dryRun"]) == ("flash-prefill-0", "report", True)
    assert cr["status"]["wedgedPods"] == 1 and cr["status"]["remediationsTotal"] == 0
    assert all(b.admin_calls() == [] for b in backends.values())
    assert not evidence_maps(kube_cluster) and not kube_cluster.removed_pods()
    assert not operator_calls(kube_cluster, "patch", "pods") and not operator_calls(
        kube_cluster, "create", "pods/eviction"
    )
    assert len(events(kube_cluster, "flash", "WedgeDetected")) == 1  # once per wedge, not once per round
    assert remediation_state(cr)["active"] == {}


async def _decode_env(client: ClusterClient) -> list[dict]:
    return (await get_cr(client, "flash"))["spec"]["decode"]["env"]


async def _decode_child_env(client: ClusterClient) -> Optional[str]:
    """SPLIT_KV_TARGET in the decode StatefulSet the reconciler built (what the pods run)."""
    sts = await client.get("apps/v1", "statefulsets", NS, "flash-decode")
    for c in (sts or {}).get("spec", {}).get("template", {}).get("spec", {}).get("containers") or []:
        for e in c.get("env") or []:
            if e.get("name") == "SPLIT_KV_TARGET":
                return e.get("value")
    return None


async def _running_revision(client: ClusterClient) -> tuple[Optional[str], list[dict[str, Any]]]:
    cr = await get_cr(client, "flash")
    doc = json.loads(cr["metadata"].get("annotations", {}).get(REVISIONS_ANNOTATION) or "{}")
    revisions = doc.get("revisions") or []
    return (revisions[-1]["hash"] if revisions else None), revisions


async def test_wedges_after_a_spec_change_name_it_and_roll_back_once(
    kube_cluster: WatchdogCluster, kube_client: ClusterClient, pod_farm, engines, operator_factory
) -> None:
    """`rollback: auto` pins the stable revision (an annotation the reconciler builds the children
    from) and leaves the spec as written, so a GitOps tool has nothing to put back."""
    await operator_factory()
    farm = pod_farm("flash")
    # maxUnavailable 0: nothing is restarted, so the wedge outlasts the rollback and the test can
    # check that the rollback happens once, not once per round.
    _, backends = await start_deployment(
        kube_client,
        farm,
        engines,
        "flash",
        {"flash-prefill-0": "healthy", "flash-decode-0": "healthy"},
        remediation={"rollback": "auto", "detectionWindowSeconds": 1, "maxUnavailable": {"prefill": 0, "decode": 0}},
        decode_env=[{"name": "SPLIT_KV_TARGET", "value": "256"}],
    )

    async def stable() -> Optional[str]:
        return (await get_cr(kube_client, "flash")).get("status", {}).get("stableRevision")

    good = await eventually(stable, timeout=15)  # quiet for 5 detection windows
    await kube_client.patch(
        API, PLURAL, NS, "flash", {"spec": {"decode": {"env": [{"name": "SPLIT_KV_TARGET", "value": "512"}]}}}
    )
    bad = await eventually(lambda: _changed_revision(kube_client, good), timeout=5)
    await eventually(lambda: _is(_decode_child_env(kube_client), "512"), timeout=10)
    backends["flash-prefill-0"].set_mode("wedged")

    [rolled] = await eventually(lambda: events(kube_cluster, "flash", "RolledBack"), timeout=DETECT)
    change = "decode.env SPLIT_KV_TARGET changed from 256 to 512"
    assert change in rolled["message"] and f"rolled back to stable revision {good}" in rolled["message"]
    # The spec is untouched; the pin names the stable revision at the spec's generation, and the
    # reconciler honours it: the decode StatefulSet is built from the stable revision again.
    cr = await get_cr(kube_client, "flash")
    assert await _decode_env(kube_client) == [{"name": "SPLIT_KV_TARGET", "value": "512"}]
    assert cr["metadata"]["generation"] == 2
    assert cr["metadata"]["annotations"][ANNOTATION_PINNED_REVISION] == f"{good}@2"
    assert not operator_calls(kube_cluster, "update", "dsv4deployments")
    await eventually(lambda: _is(_decode_child_env(kube_client), "256"), timeout=10)
    await eventually(lambda: _pinned_status(kube_client, good), timeout=10)

    async def status_after_rollback() -> Optional[dict]:
        # The RolledBack event is posted before that round's status write lands.
        cr = await get_cr(kube_client, "flash")
        last = (cr.get("status") or {}).get("lastRemediation") or {}
        return cr if last.get("action") == "rollback" and condition(cr).get("status") == "True" else None

    cr = await eventually(status_after_rollback, timeout=DETECT)
    cond = condition(cr)
    assert cond["status"] == "True" and cond["reason"] == "WedgedAfterSpecChange"
    assert change in cond["message"] and good in cond["message"]
    last = cr["status"]["lastRemediation"]
    assert (last["action"], last["fromRevision"], last["toRevision"]) == ("rollback", bad, good)
    assert last["pinned"] == f"{good}@2"
    assert cr["status"]["stableRevision"] == good
    assert cr["spec"]["remediation"]["rollback"] == "auto"  # how it heals is not part of a revision

    # The wedge goes on (nothing may be restarted): no second rollback.
    await asyncio.sleep(4 * INTERVAL)
    assert len(events(kube_cluster, "flash", "RolledBack")) == 1
    # Quiet while pinned: the pinned revision is what runs, so the bad spec is never called stable.
    backends["flash-prefill-0"].set_mode("healthy")
    await asyncio.sleep(5 * 1 + 4 * INTERVAL)  # past the quiet period (5 detection windows of 1 s)
    running, revisions = await _running_revision(kube_client)
    assert running == good and not next(r for r in revisions if r["hash"] == bad)["stable"]
    backends["flash-prefill-0"].set_mode("wedged")
    # Someone lifts the pin while it is still wedged, asking for the bad revision again: once
    # per bad revision, so this time the operator only suggests, and pins nothing.
    await kube_client.patch(API, PLURAL, NS, "flash", {"metadata": {"annotations": {ANNOTATION_PINNED_REVISION: None}}})
    suggested = await eventually(lambda: events(kube_cluster, "flash", "RollbackSuggested"), timeout=DETECT)
    assert "already rolled back" in suggested[0]["message"] and change in suggested[0]["message"]
    await eventually(lambda: _is(_decode_child_env(kube_client), "512"), timeout=10)  # the spec as written
    await asyncio.sleep(4 * INTERVAL)
    assert await _decode_env(kube_client) == [{"name": "SPLIT_KV_TARGET", "value": "512"}]
    assert ANNOTATION_PINNED_REVISION not in (await get_cr(kube_client, "flash"))["metadata"].get("annotations", {})
    assert len(events(kube_cluster, "flash", "RolledBack")) == 1
    running, revisions = await _running_revision(kube_client)
    assert running == bad and not next(r for r in revisions if r["hash"] == bad)["stable"]
    assert not kube_cluster.removed_pods()


async def _is(value: Any, expected: Any) -> bool:
    return (await value) == expected


async def _pinned_status(client: ClusterClient, good: str) -> bool:
    return ((await get_cr(client, "flash")).get("status") or {}).get("pinnedRevision") == good


async def _changed_revision(client: ClusterClient, good: str) -> Optional[str]:
    running, _ = await _running_revision(client)
    return running if running not in (None, good) else None
