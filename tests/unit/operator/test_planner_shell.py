"""The planner's shell, its pure parts: when a role is paused, what the watchdog remediates, a
drain to resume; and what `scaling: planner` changes in the spec, the manifests and the status."""

from __future__ import annotations

import json

from dsv4_operator import manifests as M
from dsv4_operator.canary.plan import ANNOTATION_CANARY
from dsv4_operator.planner.decision import Drain, PlannerState, Settings
from dsv4_operator.planner.shell import canary_pause, planner_drained, remediating, resume_drains, rollout_pause
from dsv4_operator.spec import parse_spec
from dsv4_operator.status import compute_status, observe
from dsv4_operator.watchdog.policy import STATE_ANNOTATION, PolicyState, RemediationRecord
from dsv4_wire import ANNOTATION_PLANNER_DRAIN, LABEL_DRAINING

BASE = {"model": {"name": "m", "path": "/models/m"}, "engine": {"image": "reg/dsv4:1"}}
OWNER = M.Owner("flash", "serving", "uid-1")


def sts(generation=2, observed=2, current="a", update="a", partition=0, replicas=3) -> dict:
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": replicas, "updateStrategy": {"rollingUpdate": {"partition": partition}}},
        "status": {"observedGeneration": observed, "currentRevision": current, "updateRevision": update},
    }


def test_a_role_in_a_rollout_or_a_canary_probe_is_paused() -> None:
    assert rollout_pause(sts()) is None
    assert "rollout" in rollout_pause(sts(update="b"))
    assert "not seen" in rollout_pause(sts(generation=3))
    assert "held" in rollout_pause(sts(partition=M.HOLD_PARTITION))
    assert rollout_pause(None) is not None
    probing = {
        ANNOTATION_CANARY: json.dumps(
            {"state": {"revision": "r2", "role": "decode", "pod": "flash-decode-2", "phase": "Probing"}}
        )
    }
    assert "flash-decode-2" in canary_pause(probing, "decode")
    assert canary_pause(probing, "prefill") is None
    passed = {
        ANNOTATION_CANARY: json.dumps({"state": {"revision": "r2", "role": "decode", "pod": "p", "phase": "Passed"}})
    }
    assert canary_pause(passed, "decode") is None and canary_pause({ANNOTATION_CANARY: "{bad"}, "decode") is None


def test_the_pods_the_watchdog_remediates_per_role() -> None:
    state = PolicyState(active={"flash-decode-1": RemediationRecord("flash-decode-1", "decode", "stuck", 1.0, 1)})
    annotations = {STATE_ANNOTATION: state.to_json()}
    assert remediating(annotations, "decode") == ("flash-decode-1",)
    assert remediating(annotations, "prefill") == () == remediating({}, "decode")


def pod(name: str, role: str, drained: bool = True, terminating: bool = False) -> dict:
    meta = {
        "name": name,
        "uid": f"u-{name}",
        "labels": {"app.kubernetes.io/instance": "flash", "serving.dsv4.dev/role": role},
        "ownerReferences": [{"kind": "StatefulSet", "name": f"flash-{role}", "controller": True}],
    }
    if drained:
        meta["labels"][LABEL_DRAINING] = "true"
        meta["annotations"] = {ANNOTATION_PLANNER_DRAIN: "scale-down"}
    if terminating:
        meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    return {"metadata": meta, "spec": {}, "status": {"phase": "Running"}}


def test_a_drain_found_on_the_pods_is_resumed_after_a_restart() -> None:
    pods = [
        pod("flash-decode-0", "decode", drained=False),
        pod("flash-decode-3", "decode"),
        pod("flash-decode-2", "decode"),
        pod("flash-decode-4", "decode", terminating=True),
        pod("flash-prefill-1", "prefill"),
    ]
    assert planner_drained(pods, "decode") == ("flash-decode-2", "flash-decode-3")
    replicas = {"decode": 4, "prefill": 2}
    state = resume_drains(PlannerState(), {"decode": planner_drained(pods, "decode"), "prefill": ()}, replicas, 50.0)
    assert state.role("decode").drain == Drain(("flash-decode-2", "flash-decode-3"), 2, 50.0)
    assert state.role("prefill").drain is None
    again = resume_drains(state, {"decode": ("flash-decode-3",)}, replicas, 99.0)  # a known drain stays as it was
    assert again.role("decode").drain.started_at == 50.0
    # the count already dropped past them: a finished drain whose pods are on their way out
    assert (
        resume_drains(PlannerState(), {"decode": ("flash-decode-3",)}, {"decode": 3}, 9.0).role("decode").drain is None
    )


def test_scaling_planner_leaves_replicas_to_the_planner_within_its_bounds() -> None:
    spec = parse_spec(
        {
            **BASE,
            "decode": {"scaling": "planner", "replicas": 1},
            "planner": {"decode": {"minReplicas": 2, "maxReplicas": 5}},
        }
    )
    assert spec.planned_roles() == ["decode"]
    assert spec.replicas_from_workload("decode") and not spec.replicas_from_workload("prefill")
    assert "replicas" not in M.engine_statefulset(spec, OWNER, "decode")["spec"]
    assert M.engine_statefulset(spec, OWNER, "prefill")["spec"]["replicas"] == 1
    assert M.initial_replicas(spec, "decode") == 2  # the starting count, raised to minReplicas
    settings = Settings.from_spec(spec)
    assert (settings.min_replicas["decode"], settings.max_replicas["decode"], settings.max_unavailable["decode"]) == (
        2,
        5,
        1,
    )
    # status reports the workload's own count as desired, as for external
    live = M.engine_statefulset(spec, OWNER, "decode")
    live["spec"]["replicas"] = 4
    live["status"] = {"replicas": 4, "readyReplicas": 3}
    status = compute_status(
        spec=spec, spec_error=None, generation=1, observed_generation=1, children=[observe(live)], previous={}, now="t"
    )
    assert status["decode"]["ready"] == "3/4"


def test_planner_settings_are_no_new_revision_and_a_spec_without_them_keeps_its_revision() -> None:
    from dsv4_operator.watchdog.revisions import spec_hash

    plain = {**BASE, "decode": {"scaling": "planner"}}
    tuned = {**plain, "planner": {"ttftTargetSeconds": 1.0}}
    assert spec_hash(plain) == spec_hash(tuned)
    from dsv4_operator.spec import dump

    assert "planner" not in dump(parse_spec(BASE))  # absent stays absent: older objects hash as before
