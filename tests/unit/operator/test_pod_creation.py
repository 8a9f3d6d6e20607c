"""pod_creation: a StatefulSet controller's FailedCreate Event -> the role's Degraded message, for as
long as that StatefulSet is short of pods."""

from __future__ import annotations

from dsv4_operator.pod_creation import CreationFailure, creation_failure, standing_failures
from dsv4_operator.spec import parse_spec
from dsv4_operator.status import ChildObservation, compute_status

MESSAGE = (
    'create Pod x-prefill-0 in StatefulSet x-prefill failed error: pods "x-prefill-0" is forbidden: '
    'violates PodSecurity "baseline:latest": non-default capabilities'
)


def event(**over) -> dict:
    body = {
        "kind": "Event",
        "metadata": {"name": "x-prefill.1", "namespace": "ns"},
        "reason": "FailedCreate",
        "type": "Warning",
        "message": MESSAGE,
        "involvedObject": {"kind": "StatefulSet", "name": "x-prefill", "namespace": "ns", "uid": "u1"},
    }
    body.update(over)
    return body


def sts(created: int, replicas: int = 1, uid: str = "u1") -> ChildObservation:
    return ChildObservation(
        role="prefill",
        kind="StatefulSet",
        name="x-prefill",
        spec_replicas=replicas,
        generation=1,
        observed_generation=1,
        ready=0,
        updated=0,
        created=created,
        uid=uid,
    )


def test_only_a_statefulsets_failed_create_counts() -> None:
    assert creation_failure(event()) == CreationFailure("ns", "x-prefill", "u1", MESSAGE)
    assert creation_failure(event(reason="SuccessfulCreate")) is None
    assert creation_failure(event(involvedObject={"kind": "ReplicaSet", "name": "r"})) is None


def test_a_failure_stands_while_pods_are_missing_on_the_same_statefulset() -> None:
    failures = {("ns", "x-prefill"): creation_failure(event())}
    assert standing_failures(failures, "ns", [sts(created=0)]) == {"prefill": MESSAGE}
    assert standing_failures(failures, "ns", [sts(created=1)]) == {}  # the controller made the pod
    assert standing_failures(failures, "ns", [sts(created=0, uid="u2")]) == {}  # another StatefulSet now
    assert standing_failures(failures, "other", [sts(created=0)]) == {}


def test_compute_status_reports_it_as_degraded_failed_create() -> None:
    spec = parse_spec({"model": {"name": "m", "path": "/m"}, "engine": {"image": "i"}})
    status = compute_status(
        spec=spec,
        generation=1,
        observed_generation=1,
        children=[sts(created=0)],
        previous=None,
        now="2026-12-02T00:00:00Z",
        creation_failures={"prefill": MESSAGE},
    )
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Degraded"]["status"] == "True" and conditions["Degraded"]["reason"] == "FailedCreate"
    assert conditions["Degraded"]["message"] == f"prefill: {MESSAGE}"
    assert "prefill pods cannot be created" in conditions["Progressing"]["message"]
