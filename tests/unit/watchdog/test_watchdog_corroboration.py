"""Corroborate before acting: silence alone never restarts a pod the kubelet reports Ready, an
operator that went blind (most Ready pods silent together) holds every silence-based restart, a
pod wedged on its own metrics is still remediated, and the operator-wide restart rate limit."""

import pytest

from dsv4_operator.watchdog.corroboration import (
    FleetSilence,
    RestartRateLimit,
    Silence,
    is_blind,
    observe_silence,
)
from dsv4_operator.watchdog.detector import Detector, Healthy, Unreachable, Wedged
from dsv4_operator.watchdog.policy import (
    HELD,
    HOLD_BUDGET,
    HOLD_OPERATOR_BLIND,
    HOLD_RATE_LIMIT,
    HOLD_UNCORROBORATED,
    REPORT,
    STEPS,
    PodInfo,
    PolicyState,
    RemediationSettings,
    complete_step,
    decide,
)
from dsv4_operator.watchdog.signals import EngineSample, unreachable_sample

SETTINGS = RemediationSettings(
    cooldown_s=300, max_backoff_s=1200, reset_after_s=3600, recovery_timeout_s=600, restart_grace_s=10
)
SILENT = Wedged("unresponsive", {"silent_seconds": 130.0})
STUCK = Wedged("stuck_inflight", {"stuck_seconds": 130.0})


def ready_pods(*names, ready=True):
    return {n: PodInfo("prefill" if "prefill" in n else "decode", ready=ready, uid=f"{n}-1") for n in names}


def kinds(actions):
    return [(a.kind, a.pod, a.reason) for a in actions]


def test_a_silent_pod_the_kubelet_reports_ready_is_held_not_reported():
    pods = ready_pods("prefill-0", "prefill-1", "decode-0")
    actions, state = decide(
        {"prefill-0": SILENT, "prefill-1": Healthy(), "decode-0": Healthy()}, pods, PolicyState(), 100.0, SETTINGS
    )
    assert kinds(actions) == [(HELD, "prefill-0", HOLD_UNCORROBORATED)]
    assert actions[0].details == {"kubelet_ready": True}
    assert not state.active and not state.reported
    # Held once per episode: no Event storm while it stays silent.
    actions, state = decide(
        {"prefill-0": SILENT, "prefill-1": Healthy(), "decode-0": Healthy()}, pods, state, 110.0, SETTINGS
    )
    assert actions == []


@pytest.mark.parametrize(
    "info",
    [PodInfo("prefill", ready=False, uid="u"), PodInfo("prefill", ready=True, uid="u", restarting=True)],
    ids=["kubelet_not_ready", "container_restarting"],
)
def test_a_silent_pod_is_restarted_when_the_cluster_agrees(info):
    pods = {"prefill-0": info, **ready_pods("prefill-1")}
    actions, state = decide({"prefill-0": SILENT, "prefill-1": Healthy()}, pods, PolicyState(), 100.0, SETTINGS)
    assert [a.kind for a in actions] == [REPORT, *STEPS]
    assert "prefill-0" in state.active


def test_most_ready_pods_silent_together_is_the_operators_fault_hold_everything_but_a_real_wedge():
    names = [f"prefill-{i}" for i in range(4)] + [f"decode-{i}" for i in range(4)]
    pods = ready_pods(*names)
    pods["decode-3"] = PodInfo("decode", ready=False, uid="decode-3-1")  # not Ready, silent too
    verdicts = {n: SILENT for n in names}
    verdicts["prefill-0"] = STUCK  # answers, and its own metrics show the hand-off stuck
    verdicts["decode-0"] = Healthy()
    silence = observe_silence(verdicts, pods)
    assert silence.ready == 7 and len(silence.silent) == 5 and silence.blind
    actions, state = decide(verdicts, pods, PolicyState(), 100.0, SETTINGS, blind=silence.blind)
    assert set(state.active) == {"prefill-0"}
    assert [a.kind for a in actions if a.pod == "prefill-0"] == [REPORT, *STEPS]
    held = {a.pod: a.reason for a in actions if a.kind == HELD}
    assert held == {n: HOLD_OPERATOR_BLIND for n in names if n not in ("prefill-0", "decode-0")}
    assert not [a for a in actions if a.kind == REPORT and a.pod != "prefill-0"]


def test_blindness_needs_more_than_half_and_more_than_one():
    assert not is_blind(1, 1) and not is_blind(1, 2) and not is_blind(2, 4)
    assert is_blind(2, 2) and is_blind(3, 4) and is_blind(5, 8)
    assert not Silence(ready=8, silent=("a",)).blind


def test_the_fleet_sees_a_partition_spread_over_deployments():
    fleet = FleetSilence(ttl_s=60)
    # Each deployment alone: one silent pod of two, not blind; together: 3 of 4... of 6 Ready.
    assert not fleet.judge("a", Silence(2, ("a-0",)), 0.0)
    assert not fleet.judge("b", Silence(2, ("b-0",)), 1.0)  # 2 of 4: not more than half
    assert fleet.judge("c", Silence(2, ("c-0", "c-1")), 2.0)  # blind on its own
    assert fleet.judge("a", Silence(2, ("a-0",)), 3.0)  # 4 of 6 across the operator
    # Old reports stop speaking; a deployment that went away is forgotten.
    fleet.forget("c")
    assert not fleet.judge("a", Silence(2, ("a-0",)), 100.0)


def test_restart_rate_limit_is_a_sliding_window():
    limit = RestartRateLimit(max_restarts=2, per_seconds=60)
    assert limit.allowance(0) == 2
    limit.record(0)
    limit.record(10)
    assert limit.allowance(30) == 0
    assert limit.allowance(60) == 1 and limit.allowance(70) == 2
    assert RestartRateLimit.parse("3/120") == RestartRateLimit(3, 120.0)
    assert RestartRateLimit.parse(None).max_restarts == 10
    with pytest.raises(ValueError):
        RestartRateLimit.parse("3/0")


def test_the_global_allowance_holds_new_remediations_beyond_it():
    pods = ready_pods("prefill-0", "decode-0", "prefill-1")
    verdicts = {"prefill-0": STUCK, "decode-0": Wedged("scheduler_stalled"), "prefill-1": Healthy()}
    actions, state = decide(verdicts, pods, PolicyState(), 0.0, SETTINGS, restart_allowance=1)
    assert set(state.active) == {"decode-0"}  # sorted order: decode-0 first
    assert (HELD, "prefill-0", HOLD_RATE_LIMIT) in kinds(actions)
    # An open remediation goes on whatever the allowance; the held pod starts when allowed.
    for a in actions:
        if a.kind in STEPS:
            state = complete_step(state, a.pod, a.kind, 1.0)
    actions, state = decide(verdicts, pods, state, 5.0, SETTINGS, restart_allowance=0)
    assert "prefill-0" not in state.active
    actions, state = decide(verdicts, pods, state, 10.0, SETTINGS, restart_allowance=1)
    assert "prefill-0" in state.active


def test_the_budget_still_applies_after_corroboration():
    pods = ready_pods("prefill-0", "prefill-1", ready=False)
    actions, state = decide({"prefill-0": SILENT, "prefill-1": SILENT}, pods, PolicyState(), 0.0, SETTINGS)
    # Both not Ready: both count as unavailable, so maxUnavailable 1 holds both.
    assert {(a.kind, a.reason) for a in actions if a.kind == HELD} == {(HELD, HOLD_BUDGET)}


def _sample(t, role, reachable):
    if not reachable:
        return unreachable_sample(t, role, error="ConnectTimeout")
    return EngineSample(
        timestamp=t,
        role=role,
        reachable=True,
        num_running=0,
        num_queue=0,
        prefill_inflight=0,
        decode_transfer=0,
        transfers_completed=3,
        loop_iterations=t * 50,
        generation_tokens=0,
        prompt_tokens=0,
    )


def simulate(pod_names, unreachable, hours, interval=10.0, window=120.0):
    """Detector + policy, round after round, as the runner sequences them (with every step done at
    once), for pods the kubelet keeps Ready; returns every action taken."""
    detector = Detector(window)
    pods = ready_pods(*pod_names)
    state, fleet, taken = PolicyState(), FleetSilence(), []
    t = 0.0
    while t <= hours * 3600:
        verdicts = {
            n: detector.observe(n, _sample(t, pods[n].role, n not in unreachable or t < 60), answered_before=True)
            for n in pod_names
        }
        blind = fleet.judge("d", observe_silence(verdicts, pods), t)
        actions, state = decide(verdicts, pods, state, t, SETTINGS, blind=blind)
        for a in actions:
            if a.kind in STEPS:
                state = complete_step(state, a.pod, a.kind, t)
        taken.extend(actions)
        t += interval
    return taken


def test_a_simulated_day_of_partition_restarts_nothing():
    names = [f"prefill-{i}" for i in range(4)] + [f"decode-{i}" for i in range(4)]
    taken = simulate(names, set(names), hours=24)
    assert not [a for a in taken if a.kind in STEPS or a.kind == REPORT]
    # One hold per pod for the whole day (the episode never ends), each saying why.
    assert sorted((a.pod, a.reason) for a in taken) == sorted((n, HOLD_OPERATOR_BLIND) for n in names)


def test_a_day_with_one_ready_pod_unreachable_restarts_nothing():
    names = [f"prefill-{i}" for i in range(4)] + [f"decode-{i}" for i in range(4)]
    taken = simulate(names, {"decode-2"}, hours=24)
    assert [(a.kind, a.pod, a.reason) for a in taken] == [(HELD, "decode-2", HOLD_UNCORROBORATED)]


def test_unreachable_before_the_window_is_no_wedge_and_no_hold():
    pods = ready_pods("prefill-0")
    actions, _ = decide({"prefill-0": Unreachable(0.0)}, pods, PolicyState(), 10.0, SETTINGS)
    assert actions == []


def test_a_zero_rate_limit_is_the_fleet_wide_off_switch():
    """`operator.restartRateLimit: "0/600"` (docs/operations.md): every new remediation of every
    deployment is held (reported, never acted on); nothing starts."""
    limit = RestartRateLimit.parse("0/600")
    pods = ready_pods("prefill-0", "decode-0")
    verdicts = {"prefill-0": STUCK, "decode-0": Wedged("scheduler_stalled")}
    actions, state = decide(verdicts, pods, PolicyState(), 0.0, SETTINGS, restart_allowance=limit.allowance(0.0))
    assert not state.active and not [a for a in actions if a.kind in STEPS]
    assert {(HELD, "prefill-0", HOLD_RATE_LIMIT), (HELD, "decode-0", HOLD_RATE_LIMIT)} <= set(kinds(actions))
