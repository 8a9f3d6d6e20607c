"""status.compute_status: children as observed -> conditions and per-role counts."""

from __future__ import annotations

from typing import Any, Optional

from dsv4_operator.spec import parse_spec
from dsv4_operator.status import ChildObservation, compute_status, observe, status_changed

T0, T1 = "2026-11-29T10:00:00Z", "2026-11-29T10:05:00Z"


def spec(**roles: int):
    return parse_spec(
        {
            "model": {"name": "m", "path": "/m"},
            "engine": {"image": "i"},
            "prefill": {"replicas": roles.get("prefill", 1)},
            "decode": {"replicas": roles.get("decode", 1)},
            "router": {"replicas": roles.get("router", 1)},
        }
    )


def child(
    role: str, replicas: int = 1, ready: int = 1, updated: Optional[int] = None, gen: int = 1, observed: int = 1
) -> ChildObservation:
    return ChildObservation(
        role=role,
        kind="Deployment" if role == "router" else "StatefulSet",
        name=f"x-{role}",
        spec_replicas=replicas,
        generation=gen,
        observed_generation=observed,
        ready=ready,
        updated=replicas if updated is None else updated,
    )


def all_ready(n: int = 1) -> list[ChildObservation]:
    return [child(r, n, n) for r in ("prefill", "decode", "router")]


def cond(status: dict, ctype: str) -> dict:
    return next(c for c in status["conditions"] if c["type"] == ctype)


def compute(**kw: Any) -> dict:
    args: dict[str, Any] = dict(spec=spec(), generation=1, observed_generation=1, children=[], previous=None, now=T0)
    args.update(kw)
    return compute_status(**args)


def test_nothing_running_yet() -> None:
    st = compute()
    assert cond(st, "Available")["status"] == "False"
    assert "prefill, decode, router" in cond(st, "Available")["message"]
    assert cond(st, "Progressing").items() >= {"status": "True", "reason": "RollingOut"}.items()
    assert cond(st, "Degraded")["status"] == "False"
    assert cond(st, "Wedged") == {
        "type": "Wedged",
        "status": "Unknown",
        "reason": "NotEvaluated",
        "message": "the wedge watchdog has not reported",
        "lastTransitionTime": T0,
    }
    assert st["prefill"] == {"replicas": 1, "readyReplicas": 0, "updatedReplicas": 0, "ready": "0/1"}
    assert st["observedGeneration"] == 1 and st["wedgedPods"] == 0
    assert [c["type"] for c in st["conditions"]] == ["Available", "Progressing", "Degraded", "Wedged"]


def test_all_ready_is_available_and_complete() -> None:
    st = compute(
        spec=spec(prefill=2, decode=3), children=[child("prefill", 2, 2), child("decode", 3, 3), child("router", 1, 1)]
    )
    assert cond(st, "Available")["status"] == "True"
    assert cond(st, "Progressing")["status"] == "False"
    assert cond(st, "Progressing")["reason"] == "RolloutComplete"
    assert st["decode"]["ready"] == "3/3" and st["router"]["ready"] == "1/1"
    assert all(c.get("observedGeneration") == 1 for c in st["conditions"] if c["type"] != "Wedged")


def test_partially_ready_is_available_but_progressing() -> None:
    st = compute(spec=spec(decode=2), children=[child("prefill"), child("decode", 2, 1), child("router")])
    assert cond(st, "Available")["status"] == "True"
    assert cond(st, "Progressing")["status"] == "True"
    assert st["decode"]["ready"] == "1/2"


def test_child_not_yet_at_new_replicas_or_generation_is_progressing() -> None:
    stale_replicas = [child("prefill", 1, 1), child("decode"), child("router")]
    assert cond(compute(spec=spec(prefill=2), children=stale_replicas), "Progressing")["status"] == "True"
    not_observed = [child("prefill", gen=2, observed=1), child("decode"), child("router")]
    assert cond(compute(children=not_observed), "Progressing")["status"] == "True"
    not_updated = [child("prefill", 1, 1, updated=0), child("decode"), child("router")]
    assert cond(compute(children=not_updated), "Progressing")["status"] == "True"


def test_spec_not_yet_acted_on() -> None:
    st = compute(generation=3, observed_generation=2, children=all_ready())
    assert cond(st, "Progressing").items() >= {"status": "True", "reason": "SpecChanged"}.items()
    assert st["observedGeneration"] == 2


def test_invalid_spec_is_degraded_not_progressing_and_keeps_counting_children() -> None:
    st = compute(spec=None, spec_error="spec.prefill.replicas: must be >= 0", children=all_ready(2))
    assert (
        cond(st, "Degraded").items()
        >= {"status": "True", "reason": "InvalidSpec", "message": "spec.prefill.replicas: must be >= 0"}.items()
    )
    assert cond(st, "Progressing").items() >= {"status": "False", "reason": "InvalidSpec"}.items()
    assert cond(st, "Available")["status"] == "True"  # what runs keeps serving
    assert st["prefill"]["ready"] == "2/2"


def test_apply_failure_is_degraded() -> None:
    st = compute(apply_error="422 Invalid: bad affinity")
    assert cond(st, "Degraded").items() >= {"status": "True", "reason": "ApplyFailed"}.items()


def test_transition_time_moves_only_on_flips() -> None:
    first = compute(children=[], now=T0)
    same = compute(children=[], previous=first, now=T1)
    assert cond(same, "Available")["lastTransitionTime"] == T0
    flipped = compute(children=all_ready(), previous=first, now=T1)
    assert cond(flipped, "Available")["lastTransitionTime"] == T1
    assert cond(flipped, "Degraded")["lastTransitionTime"] == T0


def test_watchdog_owned_fields_are_carried_over() -> None:
    wedged = {
        "type": "Wedged",
        "status": "True",
        "reason": "InflightStuck",
        "message": "x-prefill-0",
        "lastTransitionTime": T0,
    }
    previous = {
        "conditions": [wedged],
        "wedgedPods": 1,
        "remediationsTotal": 4,
        "stableRevision": "abc",
        "lastRemediation": {"pod": "x-prefill-0", "action": "restart", "extra": {"kept": True}},
    }
    st = compute(previous=previous, now=T1, revision="def")
    assert cond(st, "Wedged") == wedged
    assert st["wedgedPods"] == 1 and st["remediationsTotal"] == 4 and st["stableRevision"] == "abc"
    assert st["lastRemediation"]["extra"] == {"kept": True}
    assert st["revision"] == "def"
    assert compute(previous={"revision": "old"})["revision"] == "old"


def test_observe_reads_workloads_and_ignores_others() -> None:
    sts = {
        "kind": "StatefulSet",
        "metadata": {"name": "x-decode", "generation": 4, "labels": {"serving.dsv4.dev/role": "decode"}},
        "spec": {"replicas": 3},
        "status": {"observedGeneration": 3, "readyReplicas": 2, "updatedReplicas": 1},
    }
    assert observe(sts) == ChildObservation(
        role="decode",
        kind="StatefulSet",
        name="x-decode",
        spec_replicas=3,
        generation=4,
        observed_generation=3,
        ready=2,
        updated=1,
    )
    fresh = {
        "kind": "Deployment",
        "metadata": {"name": "x-router", "labels": {"serving.dsv4.dev/role": "router"}},
        "spec": {"replicas": 1},
    }
    assert observe(fresh).ready == 0 and not observe(fresh).settled
    assert observe({"kind": "Service", "metadata": {"labels": {"serving.dsv4.dev/role": "router"}}}) is None
    assert observe({"kind": "StatefulSet", "metadata": {"labels": {}}}) is None


def test_status_changed() -> None:
    st = compute()
    assert not status_changed(st, compute())
    assert status_changed(st, compute(children=all_ready()))
    assert not status_changed(dict(st, kopf={"x": 1}), st)  # fields others own do not count


def test_router_scaled_to_zero_does_not_hold_available_false() -> None:
    """The first status bug: router.replicas 0 (a deployment behind its own gateway) left
    Available False forever."""
    st = compute(spec=spec(router=0), children=[child("prefill"), child("decode"), child("router", 0, 0)])
    assert cond(st, "Available")["status"] == "True"
    assert cond(st, "Progressing")["reason"] == "RolloutComplete"
    assert st["router"]["ready"] == "0/0"
    # Engines at zero still cannot serve.
    st = compute(
        spec=spec(decode=0, router=0), children=[child("prefill"), child("decode", 0, 0), child("router", 0, 0)]
    )
    assert cond(st, "Available")["status"] == "False" and cond(st, "Available")["message"].endswith("decode")


def test_repeated_wedges_make_the_deployment_degraded() -> None:
    """The second status bug: the manual says Degraded turns True when wedges keep happening;
    it never did. The watchdog's policy state remembers remediations per pod until a quiet spell."""
    from dsv4_operator.status import REPEATED_WEDGES, remediation_counts
    from dsv4_operator.watchdog.policy import STATE_ANNOTATION, PodHistory, PolicyState

    once = PolicyState(history={"x-prefill-0": PodHistory(count=1, last_finished_at=1.0, last_wedged_at=1.0)})
    again = PolicyState(
        history={
            "x-prefill-0": PodHistory(count=REPEATED_WEDGES, last_finished_at=2.0, last_wedged_at=2.0),
            "x-decode-1": PodHistory(count=1, last_finished_at=2.0, last_wedged_at=2.0),
        }
    )
    st = compute(children=all_ready(), remediation_counts=remediation_counts({STATE_ANNOTATION: once.to_json()}))
    assert cond(st, "Degraded")["status"] == "False"
    st2 = compute(
        children=all_ready(),
        previous=st,
        now=T1,
        remediation_counts=remediation_counts({STATE_ANNOTATION: again.to_json()}),
    )
    degraded = cond(st2, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "RepeatedWedges"
    assert "x-prefill-0 x2" in degraded["message"] and "x-decode-1" not in degraded["message"]
    assert degraded["lastTransitionTime"] == T1
    # Forgotten after a quiet spell (the watchdog drops the history): Degraded clears.
    st3 = compute(children=all_ready(), previous=st2, now=T1, remediation_counts=remediation_counts({}))
    assert cond(st3, "Degraded")["status"] == "False"
    # An invalid spec still says so first.
    st4 = compute(spec=None, spec_error="bad", children=all_ready(), remediation_counts={"p": 5})
    assert cond(st4, "Degraded")["reason"] == "InvalidSpec"
    assert remediation_counts({STATE_ANNOTATION: "not json"}) == {}


def test_externally_scaled_role_is_measured_against_its_workload() -> None:
    from dsv4_operator.spec import parse_spec as parse

    ext = parse(
        {
            "model": {"name": "m", "path": "/m"},
            "engine": {"image": "i"},
            "decode": {"replicas": 1, "scaling": "external"},
        }
    )
    st = compute(spec=ext, children=[child("prefill"), child("decode", 5, 5), child("router")])
    assert st["decode"]["ready"] == "5/5" and cond(st, "Progressing")["reason"] == "RolloutComplete"
    st = compute(spec=ext, children=[child("prefill"), child("decode", 5, 3), child("router")])
    assert st["decode"]["ready"] == "3/5" and cond(st, "Progressing")["reason"] == "RollingOut"


def test_a_held_decode_is_named_in_progressing() -> None:
    from dsv4_operator.manifests import HOLD_PARTITION

    body = {
        "kind": "StatefulSet",
        "metadata": {"name": "x-decode", "generation": 3, "labels": {"serving.dsv4.dev/role": "decode"}},
        "spec": {"replicas": 1, "updateStrategy": {"rollingUpdate": {"partition": HOLD_PARTITION}}},
        "status": {"observedGeneration": 3, "readyReplicas": 1, "updatedReplicas": 0},
    }
    decode = observe(body)
    assert decode is not None and decode.held
    st = compute(children=[child("prefill", 1, 0), decode, child("router")])
    assert cond(st, "Progressing")["message"].endswith("decode waits for prefill to roll out first")


def test_the_status_names_who_watches_it() -> None:
    """`kubectl get dsv4d -A` shows WATCHED-BY from this field: a namespace nobody watches has
    resources without it (issue 43)."""
    from dsv4_operator.status import operator_identity

    assert (
        compute_status(
            spec=spec(),
            generation=1,
            observed_generation=1,
            children=all_ready(),
            previous=None,
            now=T0,
            watched_by="dsv4-system",
        )["watchedBy"]
        == "dsv4-system"
    )
    assert operator_identity({"POD_NAMESPACE": "dsv4-system"}, "host") == "dsv4-system"
    assert operator_identity({}, "laptop") == "laptop"
