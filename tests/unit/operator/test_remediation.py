"""The pure parts of the Kubernetes wedge watchdog: pods -> scrape plan, spec -> settings, a
round -> the Wedged condition and status fields, Event texts."""

from __future__ import annotations

import json

import pytest

from dsv4_wire import LABEL_DRAINING as ROUTER_DRAINING_LABEL
from dsv4_operator.remediation.executor import _is_pod_object
from dsv4_operator.watchdog.pods import (
    DRAINING_LABEL,
    EnginePod,
    engine_pod,
    pod_selector,
    remediation_settings,
    scrape_timeout,
    stable_after_seconds,
    watch_plan,
)
from dsv4_operator.watchdog.report import (
    hold_message,
    merged_status,
    round_records,
    wedge_message,
    wedged_condition,
    wedged_pod_count,
)
from dsv4_operator.spec import RemediationSpec
from dsv4_operator.watchdog.detector import Healthy, Slow, Unreachable, Wedged
from dsv4_operator.watchdog.policy import (
    ABORT,
    CAPTURE_EVIDENCE,
    DRAIN,
    HELD,
    REPORT,
    RESTART,
    Action,
    PodInfo,
    RemediationRecord,
)


def pod(
    name: str = "flash-prefill-0",
    role: str = "prefill",
    *,
    ip: str = "10.0.0.7",
    ready: bool = True,
    ports: list | None = None,
    containers: list | None = None,
    **meta,
) -> dict:
    containers = (
        containers
        if containers is not None
        else [
            {"name": "sidecar", "ports": [{"name": "http", "containerPort": 9000}]},
            {
                "name": "engine",
                "ports": ports
                if ports is not None
                else [{"name": "bootstrap", "containerPort": 8998}, {"name": "http", "containerPort": 8100}],
            },
        ]
    )
    owner = meta.pop("owner", f"flash-{role}")
    refs = [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": owner, "uid": "sts", "controller": True}]
    return {
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "labels": {"app.kubernetes.io/instance": "flash", "serving.dsv4.dev/role": role, **meta.pop("labels", {})},
            "ownerReferences": refs if owner else [],
            **meta,
        },
        "spec": {"containers": containers},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_the_router_and_the_operator_agree_on_the_draining_label() -> None:
    assert DRAINING_LABEL == ROUTER_DRAINING_LABEL


def test_engine_pods_are_scraped_on_the_engine_containers_http_port() -> None:
    p = engine_pod(pod())
    assert p == EnginePod("flash-prefill-0", "uid-flash-prefill-0", "prefill", "10.0.0.7", 8100, True, False, False)
    assert p.url == "http://10.0.0.7:8100"
    assert engine_pod(pod(ip="fd00::7")).url == "http://[fd00::7]:8100"
    assert engine_pod(pod(ports=[]), default_port=8200).port == 9000  # another container's http port
    assert engine_pod(pod(containers=[]), default_port=8200).port == 8200
    assert engine_pod(pod(role="router")) is None
    # The right labels on a pod the deployment's StatefulSet does not control (issue 27): not an
    # engine, so never sent the admin token, drained or restarted.
    assert engine_pod(pod(owner=None)) is None
    assert engine_pod(pod(owner="other-prefill")) is None
    assert engine_pod(pod(owner="flash-decode")) is None  # a decode StatefulSet's pod labelled prefill
    drained = engine_pod(pod(labels={DRAINING_LABEL: "true"}, deletionTimestamp="2026-01-01T00:00:00Z"))
    assert drained.draining and drained.terminating and not drained.ready
    pending = pod(ready=False)
    pending["status"] = {"phase": "Pending"}
    assert engine_pod(pending).url is None and not engine_pod(pending).ready
    assert pod_selector("flash") == "app.kubernetes.io/instance=flash,serving.dsv4.dev/role in (prefill,decode)"


def test_the_plan_scrapes_live_pods_and_counts_every_pod() -> None:
    pods = [
        engine_pod(pod("flash-prefill-1", ready=False)),
        engine_pod(pod("flash-decode-0", "decode")),
        engine_pod(pod("flash-prefill-0", deletionTimestamp="x")),
    ]
    pending = pod("flash-prefill-2")
    pending["status"] = {"phase": "Pending"}
    plan = watch_plan([*pods, engine_pod(pending)], "sglang")
    assert [(t.key, t.role, t.kind) for t in plan.targets] == [
        ("flash-decode-0", "decode", "sglang"),
        ("flash-prefill-1", "prefill", "sglang"),
    ]
    assert plan.pods == {
        "flash-decode-0": PodInfo("decode", True, "uid-flash-decode-0"),
        "flash-prefill-0": PodInfo("prefill", False, "uid-flash-prefill-0"),
        "flash-prefill-1": PodInfo("prefill", False, "uid-flash-prefill-1"),
        "flash-prefill-2": PodInfo("prefill", False, "uid-flash-prefill-2"),
    }
    assert plan.answered_before == {
        "flash-decode-0": True,
        "flash-prefill-0": False,
        "flash-prefill-1": False,
        "flash-prefill-2": False,
    }


def test_settings_come_from_the_spec() -> None:
    rem = RemediationSpec.model_validate(
        {
            "dryRun": True,
            "scrapeIntervalSeconds": 0.5,
            "detectionWindowSeconds": 4,
            "maxUnavailable": {"prefill": 2, "decode": 0},
            "cooldownSeconds": 30,
            "captureEvidence": False,
        }
    )
    s = remediation_settings(rem)
    assert (s.enabled, s.dry_run, dict(s.max_unavailable), s.cooldown_s, s.capture_evidence) == (
        True,
        True,
        {"prefill": 2, "decode": 0},
        30.0,
        False,
    )
    assert scrape_timeout(rem) == 1.0 and scrape_timeout(RemediationSpec()) == 5.0
    assert stable_after_seconds(4.0) == 20.0


def record(pod: str, restarted_at: float | None = None) -> RemediationRecord:
    return RemediationRecord(
        pod=pod, role="prefill", reason="stuck_inflight", started_at=1.0, attempt=1, restarted_at=restarted_at
    )


def test_the_wedged_condition() -> None:
    assert wedged_condition(enabled=False, pods=3, verdicts={}, active={}, dry_run=False)["status"] == "Unknown"
    assert wedged_condition(enabled=True, pods=0, verdicts={}, active={}, dry_run=False)["reason"] == "NoEnginePods"
    calm = wedged_condition(
        enabled=True,
        pods=3,
        verdicts={"a": Healthy(), "b": Slow("handoff_slow"), "c": Unreachable(1.0)},
        active={},
        dry_run=False,
    )
    assert calm == {
        "type": "Wedged",
        "status": "False",
        "reason": "NoWedge",
        "message": "3 engine pods watched, none wedged, 1 slow, 1 not answering",
    }
    wedged = wedged_condition(
        enabled=True,
        pods=3,
        verdicts={"b": Wedged("stuck_inflight", {"stuck_seconds": 9})},
        active={"a": record("a", restarted_at=5.0), "b": record("b")},
        dry_run=True,
    )
    assert wedged == {
        "type": "Wedged",
        "status": "True",
        "reason": "WedgeDetected",
        "message": "2 wedged: a (stuck_inflight, remediation restarted), b (stuck_inflight); dry run: nothing was done",
    }
    after_change = wedged_condition(
        enabled=True,
        pods=2,
        verdicts={"b": Wedged("stuck_inflight")},
        active={},
        dry_run=False,
        suspect="wedges began 30s after generation 2 (revision r2): decode.env X changed from 1 to 2",
        rollback="suggest rolling back to r1",
    )
    assert after_change["reason"] == "WedgedAfterSpecChange"
    assert after_change["message"].endswith("decode.env X changed from 1 to 2; suggest rolling back to r1")
    assert wedged_pod_count({"b": Wedged("x"), "c": Slow("y")}, ["a", "b"]) == 2


def test_the_condition_moves_its_transition_time_only_when_it_flips() -> None:
    previous = {
        "conditions": [
            {"type": "Available", "status": "True"},
            {"type": "Wedged", "status": "False", "reason": "NoWedge", "message": "old", "lastTransitionTime": "T0"},
        ],
        "wedgedPods": 0,
    }
    same = merged_status(
        previous, {"type": "Wedged", "status": "False", "reason": "NoWedge", "message": "new"}, {"wedgedPods": 0}, "T1"
    )
    assert same["conditions"][1]["lastTransitionTime"] == "T0" and same["conditions"][1]["message"] == "new"
    assert same["conditions"][0] == {"type": "Available", "status": "True"}
    flipped = merged_status(
        previous,
        {"type": "Wedged", "status": "True", "reason": "WedgeDetected", "message": "m"},
        {"wedgedPods": 1},
        "T1",
    )
    assert flipped["conditions"][1]["lastTransitionTime"] == "T1" and flipped["wedgedPods"] == 1
    first = merged_status(
        {}, {"type": "Wedged", "status": "Unknown", "reason": "NoEnginePods", "message": ""}, {}, "T2"
    )
    assert first["conditions"] == [
        {"type": "Wedged", "status": "Unknown", "reason": "NoEnginePods", "message": "", "lastTransitionTime": "T2"}
    ]


def test_a_round_becomes_the_last_remediation_and_a_count_of_restarts() -> None:
    def act(kind: str, dry_run: bool = False) -> Action:
        return Action(kind, "p0", "prefill", "stuck_inflight", uid="u", attempt=2, dry_run=dry_run)

    last, restarts = round_records(
        [
            (act(REPORT), True, None),
            (act(CAPTURE_EVIDENCE), True, "not captured: logs"),
            (act(DRAIN), True, None),
            (act(ABORT), True, None),
            (act(RESTART), True, None),
        ],
        0.0,
        {"p0": "flash-evidence-p0"},
    )
    assert last == {
        "time": "1970-01-01T00:00:00Z",
        "pod": "p0",
        "role": "prefill",
        "action": "restart",
        "reason": "stuck_inflight",
        "dryRun": False,
        "result": "ok",
        "attempt": 2,
    }
    assert restarts == 1
    # A restart replayed after an operator restart found the pod gone: recorded, not counted.
    last, restarts = round_records([(act(RESTART), True, "already replaced")], 0.0, {})
    assert last["note"] == "already replaced" and restarts == 0
    last, _ = round_records(
        [(act(CAPTURE_EVIDENCE), False, "evidence ConfigMap not written")], 0.0, {"p0": "flash-evidence-p0"}
    )
    assert last["result"] == "failed" and last["evidence"] == "flash-evidence-p0"
    assert round_records([(act(REPORT), True, None), (act(HELD), True, None)], 0.0, {}) == (None, 0)
    last, _ = round_records([(act(REPORT, dry_run=True), True, None)], 0.0, {})
    assert (last["action"], last["dryRun"]) == ("report", True)


@pytest.mark.parametrize(
    "reason,details,expected",
    [
        (
            "budget",
            {"max_unavailable": 1, "unavailable": ["p1"]},
            "maxUnavailable.prefill is 1 and these are unavailable: p1",
        ),
        ("cooldown", {"until": 0.0, "remediations": 2}, "cooldown after 2 remediation(s), until 1970-01-01T00:00:00Z"),
        ("prefill_first", {"prefill_pods": ["p1"]}, "stuck prefill pods (p1), which are remediated first"),
    ],
)
def test_hold_messages_say_why(reason: str, details: dict, expected: str) -> None:
    message = hold_message(Action(HELD, "p0", "prefill", reason, details=details))
    assert message.startswith("p0 (prefill) not remediated: ") and expected in message


def test_wedge_messages_carry_the_evidence_in_short() -> None:
    action = Action(
        REPORT,
        "p0",
        "prefill",
        "stuck_inflight",
        dry_run=True,
        details={"pending": 1.0, "stuck_seconds": 12.5, "role": "prefill", "transfers_completed": 3},
    )
    assert (
        wedge_message(action) == "p0 (prefill) wedged: stuck_inflight (pending=1.0, stuck_seconds=12.5); "
        "dry run: no action taken"
    )


def test_an_api_server_answering_pods_log_with_the_pod_is_not_a_log() -> None:
    assert _is_pod_object(json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}}))
    assert not _is_pod_object('{"level": "info", "kind": "Pod", "metadata": {}}\n{"level": "info"}\n')
    assert not _is_pod_object("INFO engine started\n")


def test_the_kubelet_restarting_a_container_is_the_clusters_word_that_a_pod_is_in_trouble() -> None:
    crashing = pod()
    crashing["status"]["containerStatuses"] = [
        {"name": "engine", "ready": False, "restartCount": 3, "state": {"waiting": {"reason": "CrashLoopBackOff"}}}
    ]
    assert engine_pod(crashing).restarting
    steady = pod()
    steady["status"]["containerStatuses"] = [
        {"name": "engine", "ready": True, "restartCount": 2, "state": {"running": {}}}
    ]
    assert not engine_pod(steady).restarting  # restarted once, long ago: fine now
    plan = watch_plan([engine_pod(crashing)], "builtin")
    assert plan.pods["flash-prefill-0"].restarting and plan.pods["flash-prefill-0"].cluster_sees_trouble


def test_pods_held_for_silence_alone_are_not_called_wedged_and_blindness_is_unknown() -> None:
    silent = {"a": Wedged("unresponsive"), "b": Unreachable(1.0), "c": Healthy()}
    held = {"a": "uncorroborated"}
    calm = wedged_condition(enabled=True, pods=3, verdicts=silent, active={}, dry_run=False, held=held)
    assert calm["status"] == "False" and calm["reason"] == "NoWedge"
    assert "2 not answering (a Ready per the kubelet: not restarted on silence alone)" in calm["message"]
    assert wedged_pod_count(silent, [], held) == 0 and wedged_pod_count(silent, []) == 1
    blind = wedged_condition(
        enabled=True,
        pods=3,
        verdicts=silent,
        active={},
        dry_run=False,
        held={"a": "operator_blind"},
        blind="the operator cannot reach 2 of 3",
    )
    assert (blind["status"], blind["reason"], blind["message"]) == (
        "Unknown",
        "OperatorBlind",
        "the operator cannot reach 2 of 3",
    )
    # A real wedge among them is still called one, and the blindness is said too.
    mixed = wedged_condition(
        enabled=True,
        pods=3,
        verdicts=dict(silent, c=Wedged("stuck_inflight")),
        active={},
        dry_run=False,
        held={"a": "operator_blind"},
        blind="blind",
    )
    assert mixed["status"] == "True" and mixed["message"] == "1 wedged: c (stuck_inflight); blind"
    for reason, words in (
        ("uncorroborated", "kubelet reports it Ready"),
        ("operator_blind", "went silent together"),
        ("rate_limited", "restart rate limit"),
    ):
        assert words in hold_message(Action(HELD, "a", "prefill", reason))


def test_the_default_window_lets_the_engine_deadlines_act_first() -> None:
    """Issue 11: a window shorter than the engine's deadlines turned stalls the engine would have
    failed cleanly into restarts."""
    from dsv4_operator.spec import DSV4DeploymentSpec

    def spec(**over):
        base = {"model": {"name": "m", "path": "/models/m"}, "engine": {"image": "e:1"}}
        return DSV4DeploymentSpec.model_validate({**base, **over})

    builtin = spec(transfer={"bootstrapTimeoutSeconds": 40, "transferTimeoutSeconds": 50})
    assert builtin.detection_window() == 40 + 50 + 30  # decode waits bootstrap + transfer
    assert builtin.detection_window() > max(40, 50, 40 + 50)
    assert spec().detection_window() == 300 + 300 + 30
    assert spec(engine={"image": "e:1", "kind": "sglang"}).detection_window() == 120  # no inflight deadline there
    assert spec(remediation={"detectionWindowSeconds": 7}).detection_window() == 7.0  # the user's choice wins
