"""The operator's canary decisions, pure: what is gated, what the children are built from, what
the daemon does next, and what status says."""

from __future__ import annotations

import copy

import pytest
from pydantic import ValidationError

from dsv4_operator.canary import plan as P
from dsv4_operator.spec import parse_spec
from dsv4_operator.status import compute_status

HOLD = 100_000
RAW = {
    "model": {"name": "m", "path": "/models/m"},
    "engine": {"image": "reg/dsv4:1"},
    "prefill": {"replicas": 2},
    "decode": {"replicas": 3},
}


def edited(**engine) -> dict:
    raw = copy.deepcopy(RAW)
    raw["engine"].update(engine)
    return raw


def annotations(record: P.CanaryRecord) -> dict:
    return {P.ANNOTATION_CANARY: record.to_annotation()}


BASE = P.with_baseline(None, RAW)


def test_no_record_or_no_change_builds_from_the_spec() -> None:
    spec = parse_spec(RAW)
    assert P.effective("m", spec, RAW, {}, HOLD) == (spec, None)
    assert P.effective("m", spec, RAW, annotations(BASE), HOLD) == (spec, None)
    assert P.next_step(None, "m", spec, RAW).action == "baseline"
    assert P.next_step(BASE, "m", spec, RAW).action == "none"


def test_an_engine_change_moves_one_decode_pod_and_holds_prefill() -> None:
    raw = edited(image="reg/dsv4:2")
    spec = parse_spec(raw)
    built, reverted = P.effective("m", spec, raw, annotations(BASE), HOLD)
    assert reverted is None
    assert built.decode.partition == 2 and built.prefill.partition == HOLD and built.rollout.order == "together"
    assert spec.decode.partition == 0, "the parsed spec itself is not changed"
    step = P.next_step(BASE, "m", spec, raw)
    assert step.action == "probe" and step.state.pod == "m-decode-2" and step.state.role == "decode"
    assert step.state.stable_revision == BASE.baseline_revision


def test_passed_opens_failed_reverts_and_a_new_edit_starts_over() -> None:
    raw = edited(args=["--cuda-graph-max-bs", "64"])
    spec = parse_spec(raw)
    st = P.next_step(BASE, "m", spec, raw).state
    passed = P.with_baseline(BASE, raw, P.CanaryState(**{**st.to_dict(), "phase": P.PASSED}))
    assert P.effective("m", spec, raw, annotations(passed), HOLD) == (spec, None)
    failed = P.with_state(BASE, P.CanaryState(**{**st.to_dict(), "phase": P.FAILED, "summary": "2 stalled"}))
    built, reverted = P.effective("m", spec, raw, annotations(failed), HOLD)
    assert reverted == BASE.baseline_revision and built.engine.args == [] and built.decode.partition == 0
    assert P.next_step(failed, "m", spec, raw).action == "none", "a failed revision is not probed again"
    assert P.failed_for(annotations(failed), raw).summary == "2 stalled"
    again = edited(image="reg/dsv4:3")
    assert P.failed_for(annotations(failed), again) is None
    assert P.next_step(failed, "m", parse_spec(again), again).action == "probe"
    assert P.mark(annotations(failed)) != P.mark(annotations(passed))


def test_what_is_not_probed() -> None:
    off = edited(image="reg/dsv4:2")
    off["rollout"] = {"canary": {"enabled": False}}
    assert P.effective("m", parse_spec(off), off, annotations(BASE), HOLD)[0].decode.partition == 0
    assert P.next_step(BASE, "m", parse_spec(off), off).action == "baseline"
    replicas = copy.deepcopy(RAW)
    replicas["decode"]["replicas"] = 5  # no template change: nothing to probe
    assert P.next_step(BASE, "m", parse_spec(replicas), replicas).action == "baseline"
    prefill_only = copy.deepcopy(RAW)
    prefill_only["prefill"]["args"] = ["--x"]
    step = P.next_step(BASE, "m", parse_spec(prefill_only), prefill_only)
    assert step.action == "skip" and "prefill" in step.reason
    assert P.effective("m", parse_spec(prefill_only), prefill_only, annotations(BASE), HOLD)[0].prefill.partition == 0
    # remediation edits are not a new serving revision
    rem = copy.deepcopy(RAW)
    rem["remediation"] = {"dryRun": True}
    assert P.next_step(BASE, "m", parse_spec(rem), rem).action == "none"
    assert P.CanaryRecord.from_annotations({P.ANNOTATION_CANARY: "{not json"}) is None


def test_changed_roles_decode_first() -> None:
    a, b = parse_spec(RAW), parse_spec(edited(image="reg/dsv4:2"))
    assert P.changed_roles(a, b, "m") == ["decode", "prefill"]
    assert P.changed_roles(a, a, "m") == []


def test_status_says_canary_failed_with_its_figures() -> None:
    raw = edited(image="reg/dsv4:2")
    st = P.CanaryState(
        P.serving_revision(raw),
        "decode",
        "m-decode-2",
        P.FAILED,
        BASE.baseline_revision,
        {"canary": {"stalled": 2}},
        "m-canary-abc",
        "2 probe request(s) got no answer",
    )
    record = P.with_state(BASE, st)
    status = compute_status(
        spec=parse_spec(RAW),
        generation=2,
        observed_generation=2,
        children=[],
        previous={},
        now="t",
        canary=record,
        canary_failed=P.failed_for(annotations(record), raw),
    )
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "CanaryFailed" and "m-canary-abc" in degraded["message"]
    assert "no answer" in degraded["message"] and status["canary"]["figures"]["canary"]["stalled"] == 2


def test_traffic_percent_is_a_bounded_share() -> None:
    assert parse_spec({**RAW, "rollout": {"canary": {"trafficPercent": 5}}}).rollout.canary.traffic_percent == 5
    with pytest.raises(ValidationError, match="trafficPercent|traffic_percent"):
        parse_spec({**RAW, "rollout": {"canary": {"trafficPercent": 51}}})


@pytest.mark.parametrize("live", [5, 1])
def test_a_planned_decode_role_probes_the_highest_live_pod_not_the_specs(live: int) -> None:
    """The planner (or an autoscaler) sets decode's count: the canary is the highest ordinal of the
    pods that run, and the partition moves that pod alone. The spec's count (3) would move pods
    3 and 4 of five, or no pod of one (the probe then waits for a pod that never comes)."""
    planned = copy.deepcopy(RAW)
    planned["decode"] = {"replicas": 3, "scaling": "planner"}
    base = P.with_baseline(None, planned)
    raw = copy.deepcopy(planned)
    raw["engine"]["image"] = "reg/dsv4:2"
    spec = parse_spec(raw)
    assert P.next_step(base, "m", spec, raw).action == "wait", "no pod picked before the live count is known"
    # before the daemon recorded its pod: decode is held, nothing moves
    built, _ = P.effective("m", spec, raw, annotations(base), HOLD)
    assert built.decode.partition == HOLD and built.prefill.partition == HOLD
    step = P.next_step(base, "m", spec, raw, {"decode": live, "prefill": 2})
    assert step.action == "probe" and step.state.pod == f"m-decode-{live - 1}"
    built, _ = P.effective("m", spec, raw, annotations(P.with_state(base, step.state)), HOLD)
    assert built.decode.partition == live - 1 and built.prefill.partition == HOLD
