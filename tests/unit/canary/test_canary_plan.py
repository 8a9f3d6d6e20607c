"""The operator's canary decision, pure: who moves first, what is held, what a verdict does."""

from __future__ import annotations

from dsv4_operator.canary.plan import (FAILED, PASSED, CanaryState, changed_roles, degraded_condition, plan)

HOLD = 100_000
REPLICAS = {"prefill": 2, "decode": 3}


def test_no_change_no_canary():
    assert plan(True, "m", "r2", "r1", [], REPLICAS, None, HOLD).action == "none"
    assert plan(False, "m", "r2", "r1", ["decode"], REPLICAS, None, HOLD).action == "none"
    assert plan(True, "m", "r1", None, ["decode"], REPLICAS, None, HOLD).action == "none"  # first revision


def test_decode_moves_one_pod_first_and_prefill_is_held():
    step = plan(True, "m", "r2", "r1", ["decode", "prefill"], REPLICAS, None, HOLD)
    assert step.action == "start" and step.partitions == {"decode": 2, "prefill": HOLD}
    assert step.state.pod == "m-decode-2" and step.state.stable_revision == "r1"
    assert step.event[0] == "CanaryStarted"
    probing = plan(True, "m", "r2", "r1", ["decode"], REPLICAS, step.state, HOLD)
    assert probing.action == "probe" and probing.partitions == step.partitions


def test_verdicts():
    st = CanaryState("r2", "decode", "m-decode-2", PASSED, "r1")
    assert plan(True, "m", "r2", "r1", ["decode"], REPLICAS, st, HOLD).action == "continue"
    failed = plan(True, "m", "r2", "r1", ["decode"], REPLICAS, CanaryState("r2", "decode", "m-decode-2", FAILED, "r1"), HOLD)
    assert failed.action == "revert" and failed.event[0] == "CanaryFailed"
    # a new edit of the spec starts a new canary, whatever the old one said
    assert plan(True, "m", "r3", "r1", ["decode"], REPLICAS, st, HOLD).action == "start"
    cond = degraded_condition(failed.state, "2 probe request(s) got no answer", "m-canary-r2")
    assert cond["reason"] == "CanaryFailed" and "m-canary-r2" in cond["message"]


def test_changed_roles():
    live = {"decode": {"spec": {"containers": [{"args": ["--a"]}]}}, "prefill": {"spec": {"containers": [{"args": []}]}}}
    wanted = {"decode": {"spec": {"containers": [{"args": ["--b"]}]}}, "prefill": {"spec": {"containers": [{"args": []}]}}}
    assert changed_roles(live, wanted) == ["decode"]
    assert changed_roles({"decode": None}, wanted) == []  # new: nothing stable to protect
    assert CanaryState.from_dict(CanaryState("r", "decode", "p").to_dict()) == CanaryState("r", "decode", "p")
