"""The remediation policy: order of steps, disruption budget, cooldown/backoff, dry run, and
resuming after an operator restart without acting twice."""

import json

import pytest

from dsv4_operator.watchdog.detector import Healthy, Slow, Unreachable, Wedged
from dsv4_operator.watchdog.policy import (
    ABORT,
    CAPTURE_EVIDENCE,
    DRAIN,
    HELD,
    HOLD_BUDGET,
    HOLD_COOLDOWN,
    REPORT,
    RESTART,
    STEPS,
    PodInfo,
    PolicyState,
    RemediationSettings,
    backoff_seconds,
    complete_step,
    decide,
    resolve_max_unavailable,
)

WEDGED = Wedged("stuck_inflight", {"stuck_seconds": 130.0})
SETTINGS = RemediationSettings(
    cooldown_s=300, max_backoff_s=1200, reset_after_s=3600, recovery_timeout_s=600, restart_grace_s=10
)


def pods(**roles):
    """pods(p0="prefill", d0="decode") -> {name: PodInfo} (Ready, uid "<name>-1")."""
    return {name: PodInfo(role=role, ready=True, uid=f"{name}-1") for name, role in roles.items()}


def kinds(actions):
    return [(a.kind, a.pod) for a in actions]


def run_all_steps(state, actions, now):
    for a in actions:
        if a.kind in STEPS:
            state = complete_step(state, a.pod, a.kind, now)
    return state


def remediate_once(state, pod_map, pod, now, settings=SETTINGS):
    """Wedge -> all steps done -> pod comes back as a new pod.  Returns the state after."""
    actions, state = decide({pod: WEDGED}, pod_map, state, now, settings)
    assert [a.kind for a in actions if a.pod == pod and a.kind in STEPS] == list(STEPS)
    state = run_all_steps(state, actions, now + 1)
    back = dict(pod_map)
    back[pod] = PodInfo(pod_map[pod].role, ready=True, uid=f"{pod}-new@{now}")
    actions, state = decide({pod: Healthy()}, back, state, now + 60, settings)
    assert pod not in state.active
    return state


def test_one_wedged_pod_full_sequence_in_order():
    p = pods(p0="prefill", p1="prefill", d0="decode")
    actions, state = decide(
        {"p0": WEDGED, "p1": Healthy(), "d0": Slow("handoff_slow")}, p, PolicyState(), 1000.0, SETTINGS
    )
    assert kinds(actions) == [(REPORT, "p0"), (CAPTURE_EVIDENCE, "p0"), (DRAIN, "p0"), (ABORT, "p0"), (RESTART, "p0")]
    assert all(a.uid == "p0-1" and a.role == "prefill" for a in actions)
    assert actions[0].reason == "stuck_inflight" and actions[0].details["stuck_seconds"] == 130
    assert actions[1].attempt == 1
    rec = state.active["p0"]
    assert rec.steps_done == () and rec.started_at == 1000.0


def test_open_remediation_reemits_only_remaining_steps_and_never_reports_twice():
    p = pods(p0="prefill")
    actions, state = decide({"p0": WEDGED}, p, PolicyState(), 0.0, SETTINGS)
    state = complete_step(state, "p0", CAPTURE_EVIDENCE, 1.0)
    state = complete_step(state, "p0", DRAIN, 2.0)
    actions, state2 = decide({"p0": WEDGED}, p, state, 5.0, SETTINGS)
    assert kinds(actions) == [(ABORT, "p0"), (RESTART, "p0")]
    assert state2.active["p0"].started_at == 0.0  # same remediation, not a new one


def test_best_effort_steps_move_on_failed_restart_stays_pending():
    p = {"p0": PodInfo("prefill", ready=False, uid="p0-1")}  # the kubelet agrees: not Ready
    actions, state = decide({"p0": Unreachable(0.0)}, p, PolicyState(), 0.0, SETTINGS)
    assert actions == []  # unreachable is not (yet) wedged
    actions, state = decide({"p0": Wedged("unresponsive")}, p, state, 130.0, SETTINGS)
    state = complete_step(state, "p0", CAPTURE_EVIDENCE, 131, ok=False, note="stacks: timeout")
    state = complete_step(state, "p0", DRAIN, 131)
    state = complete_step(state, "p0", ABORT, 131, ok=False)
    state = complete_step(state, "p0", RESTART, 132, ok=False, note="API 500")
    rec = state.active["p0"]
    assert rec.steps_done == (CAPTURE_EVIDENCE, DRAIN, ABORT) and rec.restarted_at is None
    assert rec.notes == ("capture_evidence: stacks: timeout", "abort failed", "restart: API 500")
    actions, state = decide({"p0": Wedged("unresponsive")}, p, state, 140.0, SETTINGS)
    assert kinds(actions) == [(RESTART, "p0")]


def test_operator_restart_mid_remediation_does_not_double_act():
    p = pods(p0="prefill", p1="prefill")
    actions, state = decide({"p0": WEDGED}, p, PolicyState(), 0.0, SETTINGS)
    state = complete_step(state, "p0", CAPTURE_EVIDENCE, 1.0)
    state = complete_step(state, "p0", DRAIN, 2.0)
    saved = state.to_json()  # what the annotation holds when the operator dies
    json.loads(saved)

    resumed = PolicyState.from_json(saved)
    assert resumed == state
    actions, resumed = decide({"p0": WEDGED, "p1": WEDGED}, p, resumed, 30.0, SETTINGS)
    # No new Report or capture/drain for p0; p1 waits for the budget (1 prefill at a time).
    assert kinds(actions) == [(ABORT, "p0"), (RESTART, "p0"), (REPORT, "p1"), (HELD, "p1")]
    assert actions[-1].reason == HOLD_BUDGET

    # Died again after the restart was done: the replayed state waits for recovery, no re-delete.
    resumed = complete_step(complete_step(resumed, "p0", ABORT, 31), "p0", RESTART, 32)
    again = PolicyState.from_json(resumed.to_json())
    actions, again = decide({"p0": WEDGED, "p1": WEDGED}, p, again, 40.0, SETTINGS)
    assert kinds(actions) == []  # p0's old pod still shows (deletion pending): nothing new


def test_restart_actions_carry_uid_for_a_precondition():
    p = pods(p0="prefill")
    actions, _ = decide({"p0": WEDGED}, p, PolicyState(), 0.0, SETTINGS)
    assert [a.uid for a in actions if a.kind == RESTART] == ["p0-1"]


def test_budget_one_per_role_at_a_time():
    p = pods(p0="prefill", p1="prefill", p2="prefill", d0="decode")
    verdicts = {"p0": WEDGED, "p1": WEDGED, "d0": WEDGED}
    actions, state = decide(verdicts, p, PolicyState(), 0.0, SETTINGS)
    started = {a.pod for a in actions if a.kind == RESTART}
    assert started == {"p0", "d0"}  # roles have separate budgets
    held = [a for a in actions if a.kind == HELD]
    assert [(a.pod, a.reason) for a in held] == [("p1", HOLD_BUDGET)]
    assert held[0].details == {"max_unavailable": 1, "unavailable": ["p0"]}

    # Held is announced once per reason, not every round.
    state = run_all_steps(state, actions, 1.0)
    actions, state = decide(verdicts, p, state, 5.0, SETTINGS)
    assert kinds(actions) == []

    # p0 comes back: p1 goes next.
    p["p0"] = PodInfo("prefill", ready=True, uid="p0-2")
    actions, state = decide({"p1": WEDGED}, p, state, 50.0, SETTINGS)
    assert [a.kind for a in actions if a.pod == "p1"] == list(STEPS)


def test_not_ready_pods_count_against_the_budget():
    p = pods(p0="prefill", p1="prefill")
    p["p1"] = PodInfo("prefill", ready=False, uid="p1-1")
    actions, state = decide({"p0": WEDGED}, p, PolicyState(), 0.0, SETTINGS)
    assert kinds(actions) == [(REPORT, "p0"), (HELD, "p0")]
    # The wedged pod itself not Ready: it counts once, so it may be remediated.
    p = {"p0": PodInfo("prefill", ready=False, uid="a")}
    actions, _ = decide({"p0": WEDGED}, p, PolicyState(), 0.0, SETTINGS)
    assert RESTART in [a.kind for a in actions]


def test_pods_drained_for_a_scale_down_count_against_the_budget():
    """The planner drains up to maxUnavailable pods for a scale-down (Ready, out of the routers):
    the watchdog does not take another pod of the role out on top of them."""
    p = pods(p0="prefill", p1="prefill")
    p["p1"] = PodInfo("prefill", ready=True, uid="p1-1", draining=True)
    actions, _ = decide({"p0": WEDGED}, p, PolicyState(), 0.0, SETTINGS)
    assert kinds(actions) == [(REPORT, "p0"), (HELD, "p0")]
    assert not PodInfo("prefill", draining=True).cluster_sees_trouble, "a drain is no trouble to remediate"


def test_the_watch_plan_carries_the_draining_label():
    from dsv4_operator.watchdog.pods import EnginePod, watch_plan

    pod = EnginePod(
        name="x-prefill-1",
        uid="u",
        role="prefill",
        ip="10.0.0.1",
        port=8000,
        ready=True,
        terminating=False,
        draining=True,
    )
    assert watch_plan([pod], "builtin").pods["x-prefill-1"].draining


def test_max_unavailable_two_and_percentages():
    settings = RemediationSettings(max_unavailable={"prefill": 2, "decode": "50%"})
    p = pods(p0="prefill", p1="prefill", p2="prefill", d0="decode", d1="decode", d2="decode", d3="decode")
    verdicts = {name: WEDGED for name in p}
    actions, _ = decide(verdicts, p, PolicyState(), 0.0, settings)
    restarted = sorted(a.pod for a in actions if a.kind == RESTART)
    assert restarted == ["d0", "d1", "p0", "p1"]
    assert sorted(a.pod for a in actions if a.kind == HELD) == ["d2", "d3", "p2"]
    assert resolve_max_unavailable("25%", 3) == 1  # rounded up
    assert resolve_max_unavailable("0%", 8) == 0
    assert resolve_max_unavailable("3", 8) == 3


def test_zero_budget_holds_everything():
    settings = RemediationSettings(max_unavailable={"prefill": 0})
    actions, state = decide({"p0": WEDGED}, pods(p0="prefill"), PolicyState(), 0.0, settings)
    assert kinds(actions) == [(REPORT, "p0"), (HELD, "p0")] and not state.active


def test_restarted_pod_missing_from_the_list_still_counts():
    p = pods(p0="prefill", p1="prefill")
    actions, state = decide({"p0": WEDGED}, p, PolicyState(), 0.0, SETTINGS)
    state = run_all_steps(state, actions, 1.0)
    gone = {"p1": p["p1"]}  # p0 deleted, StatefulSet has not recreated it yet
    actions, state = decide({"p1": WEDGED}, gone, state, 10.0, SETTINGS)
    assert "p0" in state.active
    assert kinds(actions) == [(REPORT, "p1"), (HELD, "p1")]


def test_pod_gone_before_restart_closes_the_record():
    p = pods(p0="prefill")
    actions, state = decide({"p0": WEDGED}, p, PolicyState(), 0.0, SETTINGS)
    actions, state = decide({}, {}, state, 10.0, SETTINGS)
    assert not state.active and state.history["p0"].last_result == "pod_gone"


def test_recovery_timeout_releases_the_budget():
    p = pods(p0="prefill")
    actions, state = decide({"p0": WEDGED}, p, PolicyState(), 0.0, SETTINGS)
    state = run_all_steps(state, actions, 1.0)
    p["p0"] = PodInfo("prefill", ready=False, uid="p0-2")  # new pod never gets Ready
    _, state = decide({}, p, state, 300.0, SETTINGS)
    assert "p0" in state.active
    _, state = decide({}, p, state, 601.0, SETTINGS)
    assert not state.active and state.history["p0"].last_result == "recovery_timeout"


def test_local_processes_without_uid_close_after_grace():
    p = {"prefill-0": "prefill"}  # dsv4 up: bare roles, no UIDs
    actions, state = decide({"prefill-0": WEDGED}, p, PolicyState(), 0.0, SETTINGS)
    state = run_all_steps(state, actions, 1.0)
    _, state = decide({"prefill-0": Healthy()}, p, state, 5.0, SETTINGS)
    assert "prefill-0" in state.active  # within grace: the old process may still answer
    _, state = decide({"prefill-0": Healthy()}, p, state, 12.0, SETTINGS)
    assert not state.active and state.history["prefill-0"].last_result == "restarted"


def test_cooldown_with_exponential_backoff_cap_and_reset():
    p = pods(p0="prefill")
    state = remediate_once(PolicyState(), p, "p0", 0.0)  # finished at t=60
    assert state.history["p0"].count == 1
    p["p0"] = PodInfo("prefill", True, "p0-x")

    # Wedged again 100 s later: within the 300 s cooldown.
    actions, state = decide({"p0": WEDGED}, p, state, 160.0, SETTINGS)
    assert kinds(actions) == [(REPORT, "p0"), (HELD, "p0")]
    assert actions[1].reason == HOLD_COOLDOWN and actions[1].details["until"] == 360.0
    actions, state = decide({"p0": WEDGED}, p, state, 200.0, SETTINGS)
    assert actions == []  # held already announced
    # After the cooldown: remediation number 2.
    actions, state = decide({"p0": WEDGED}, p, state, 360.0, SETTINGS)
    assert [a.attempt for a in actions if a.kind in STEPS] == [2, 2, 2, 2]
    state = run_all_steps(state, actions, 361.0)
    p["p0"] = PodInfo("prefill", True, "p0-y")
    _, state = decide({}, p, state, 400.0, SETTINGS)
    assert state.history["p0"].count == 2

    # Second cooldown doubles (600 s), third would be 1200, fourth capped at 1200.
    assert [backoff_seconds(n, SETTINGS) for n in (1, 2, 3, 4, 5)] == [300, 600, 1200, 1200, 1200]
    actions, state = decide({"p0": WEDGED}, p, state, 900.0, SETTINGS)
    assert actions[-1].kind == HELD and actions[-1].details["until"] == 1000.0
    actions, state = decide({"p0": WEDGED}, p, state, 1000.0, SETTINGS)
    assert RESTART in [a.kind for a in actions]
    state = run_all_steps(state, actions, 1001.0)
    p["p0"] = PodInfo("prefill", True, "p0-z")
    _, state = decide({}, p, state, 1100.0, SETTINGS)
    assert state.history["p0"].count == 3

    # Quiet for the reset period: the count is forgotten, the next cooldown is the base again.
    _, state = decide({"p0": Healthy()}, p, state, 1100.0 + 3600.0, SETTINGS)
    assert "p0" not in state.history
    actions, state = decide({"p0": WEDGED}, p, state, 4800.0, SETTINGS)
    assert [a.attempt for a in actions if a.kind == RESTART] == [1]


def test_wedges_keep_the_backoff_count_alive():
    p = pods(p0="prefill")
    state = remediate_once(PolicyState(), p, "p0", 0.0)
    # Wedged (and held) at times that keep it from ever being quiet for an hour.
    for t in range(160, 4000, 600):
        _, state = decide({"p0": WEDGED}, p, state, float(t), RemediationSettings(max_unavailable={"prefill": 0}))
    assert state.history["p0"].count == 1


def test_dry_run_reports_and_holds_only():
    settings = RemediationSettings(dry_run=True)
    p = pods(p0="prefill", p1="prefill", d0="decode")
    verdicts = {"p0": WEDGED, "p1": WEDGED, "d0": Healthy()}
    actions, state = decide(verdicts, p, PolicyState(), 0.0, settings)
    assert kinds(actions) == [(REPORT, "p0"), (REPORT, "p1"), (HELD, "p1")]
    assert all(a.dry_run for a in actions)
    assert not state.active and not state.history
    # Next round: nothing new to say.
    actions, state = decide(verdicts, p, state, 5.0, settings)
    assert actions == []
    # The wedge ends and comes back: a new episode, reported again.
    _, state = decide({"p0": Healthy(), "p1": Healthy()}, p, state, 10.0, settings)
    actions, state = decide({"p0": WEDGED}, p, state, 20.0, settings)
    assert kinds(actions) == [(REPORT, "p0")]


def test_disabled_does_nothing():
    settings = RemediationSettings(enabled=False)
    state = PolicyState()
    actions, new = decide({"p0": WEDGED}, pods(p0="prefill"), state, 0.0, settings)
    assert actions == [] and new is state


def test_capture_evidence_can_be_switched_off():
    settings = RemediationSettings(capture_evidence=False)
    actions, _ = decide({"p0": WEDGED}, pods(p0="prefill"), PolicyState(), 0.0, settings)
    assert [a.kind for a in actions] == [REPORT, DRAIN, ABORT, RESTART]


def test_unknown_role_uses_default_budget():
    p = pods(m0="mono", m1="mono")
    actions, _ = decide({"m0": WEDGED, "m1": WEDGED}, p, PolicyState(), 0.0, SETTINGS)
    assert [a.pod for a in actions if a.kind == RESTART] == ["m0"]


def test_state_is_immutable_and_json_round_trips():
    p = pods(p0="prefill", p1="prefill")
    before = PolicyState()
    actions, after = decide({"p0": WEDGED, "p1": WEDGED}, p, before, 0.0, SETTINGS)
    assert before == PolicyState()
    with pytest.raises(TypeError):
        after.active["x"] = None  # type: ignore[index]
    after = complete_step(after, "p0", CAPTURE_EVIDENCE, 1.0, note="partial: no stacks")
    restored = PolicyState.from_json(after.to_json())
    assert restored == after
    assert restored.to_json() == after.to_json()
    assert PolicyState.from_json(None) == PolicyState()
    assert PolicyState.from_json("") == PolicyState()
    for a in actions:
        json.dumps(a.to_dict())


def test_complete_step_ignores_unknown_pod_and_duplicate():
    state = PolicyState()
    assert complete_step(state, "nope", DRAIN, 0.0) is state
    _, state = decide({"p0": WEDGED}, pods(p0="prefill"), state, 0.0, SETTINGS)
    once = complete_step(state, "p0", DRAIN, 1.0)
    assert complete_step(once, "p0", DRAIN, 2.0) is once


def test_decode_waiting_for_kv_is_held_while_a_prefill_handoff_is_stuck():
    from dsv4_operator.watchdog.policy import HOLD_PREFILL_FIRST

    pm = pods(p0="prefill", d0="decode")
    victim = Wedged("stuck_transfer", {"stuck_seconds": 130.0})
    # The decode's window fills first while the prefill is only Slow: the decode is still held.
    actions, state = decide({"d0": victim, "p0": Slow("handoff_slow")}, pm, PolicyState(), 1000.0, SETTINGS)
    assert not [a for a in actions if a.kind in STEPS]
    assert [(a.kind, a.reason) for a in actions if a.kind == HELD] == [(HELD, HOLD_PREFILL_FIRST)]
    # Next round the prefill is Wedged: only the prefill is remediated.
    actions, state = decide({"d0": victim, "p0": WEDGED}, pm, state, 1001.0, SETTINGS)
    assert {a.pod for a in actions if a.kind in STEPS} == {"p0"}
    # With no prefill in trouble, a decode stuck on its own is remediated.
    actions, _ = decide({"d0": victim, "p0": Healthy()}, pm, PolicyState(), 2000.0, SETTINGS)
    assert [a.kind for a in actions if a.pod == "d0" and a.kind in STEPS] == list(STEPS)
