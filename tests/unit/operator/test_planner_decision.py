"""One round of the planner (dsv4_operator.planner.decision.decide): pure, no I/O. The loads are
made up the way engines report them (dsv4_operator.planner.observe.EngineLoad)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from dsv4_operator.planner.decision import (
    DRAIN,
    HOLD,
    SCALE_DOWN,
    SCALE_UP,
    WAIT,
    PlannerState,
    RoleObservation,
    Settings,
    decide,
    replicas_for,
)
from dsv4_operator.planner.observe import EngineLoad

A, B, C = 0.01, 0.001, 5e-7  # the decode step of the engines below: a + b*batch + c*batch*context
CONTEXT = 1000.0
INTERVAL = 30.0


def step_s(batch: float) -> float:
    return A + B * batch + C * batch * CONTEXT


def decode_engines(n: int, tokens_per_s: float, *, ready: int | None = None, busy: dict | None = None) -> tuple:
    """n decode engines sharing `tokens_per_s` of generation: each runs the batch that gives its
    share at this step time (tokens/s = batch / step), and reports the interval's totals."""
    ready = n if ready is None else ready
    share = tokens_per_s / max(1, ready)
    # batch / (A + (B + C*CONTEXT) batch) = share  ->  batch
    per = B + C * CONTEXT
    batch = share * A / (1 - share * per) if share * per < 1 else 1e6
    out = []
    for i in range(n):
        serving = i < ready
        b = batch if serving else 0.0
        steps = INTERVAL / step_s(b) if b > 0 else 0.0
        out.append(
            EngineLoad(
                pod=f"flash-decode-{i}",
                role="decode",
                seconds=INTERVAL,
                ready=serving,
                running=(busy or {}).get(i, b),
                context=CONTEXT,
                kv_tokens_total=1e6,
                generation_tokens_per_s=share if serving else 0.0,
                itl_s=step_s(b) if b > 0 else None,
                itl_n=steps * b,
                steps={
                    "decode": {
                        "steps": steps,
                        "seconds": INTERVAL if b else 0.0,
                        "requests": steps * b,
                        "request_context": steps * b * CONTEXT,
                    }
                }
                if b
                else {},
            )
        )
    return tuple(out)


def obs(n: int, tokens_per_s: float, **kw) -> RoleObservation:
    ready = kw.pop("ready", n)
    busy = kw.pop("busy", None)
    return RoleObservation(
        "decode", n, "flash-decode", decode_engines(n, tokens_per_s, ready=ready, busy=busy), ready, **kw
    )


SETTINGS = Settings(
    interval_s=INTERVAL,
    itl_target_s=0.05,
    min_replicas={"prefill": 1, "decode": 1},
    max_replicas={"prefill": 8, "decode": 8},
    scale_down_cooldown_s=300,
    startup_s=120,
    drain_timeout_s=60,
    max_unavailable={"prefill": 1, "decode": 1},
)
CAPACITY = (0.05 - A) / (B + C * CONTEXT) / 0.05  # tokens/s of one replica at the ITL target


def run(rounds: int, n: int, load: float, state: PlannerState | None = None, t0: float = 0.0, **kw):
    """`rounds` decisions at a steady load; the count follows each decision (a scale-down once
    drained). Returns (decisions, state, count, time)."""
    state = state or PlannerState()
    settings = kw.pop("settings", SETTINGS)
    decisions, t = [], t0
    for _ in range(rounds):
        t += INTERVAL
        d = decide({"decode": obs(n, load, **kw)}, state, settings, t)
        state = d.state
        dec = d.roles["decode"]
        decisions.append(dec)
        if dec.action in (SCALE_UP, SCALE_DOWN):
            n = dec.target
    return decisions, state, n, t


def test_replicas_for() -> None:
    assert replicas_for(0, 100, 0.8, 1, 8) == 1
    assert replicas_for(160, 100, 0.8, 1, 8) == 2
    assert replicas_for(161, 100, 0.8, 1, 8) == 3
    assert replicas_for(1e9, 100, 0.8, 1, 8) == 8
    assert replicas_for(5, 0, 0.8, 1, 8) == 8  # one replica serves nothing at the target: all we may


def test_a_load_above_the_capacity_scales_up_to_what_the_model_says() -> None:
    load = 2.5 * CAPACITY
    decisions, state, n, _ = run(4, 1, load)
    ups = [d for d in decisions if d.action == SCALE_UP]
    assert ups, [d.message() for d in decisions]
    # the fitted model knows the engine: the count is the demand over 80% of the true capacity
    assert n == math.ceil(load / (0.8 * CAPACITY))
    last = decisions[-1]
    assert last.numbers["capacity_per_replica"] == pytest.approx(CAPACITY, rel=0.1)
    assert "gen tok/s" in ups[0].message() and str(ups[0].target) in ups[0].message()


def test_starting_replicas_count_no_second_scale_up_while_they_start() -> None:
    load = 2.5 * CAPACITY
    _, state, n, t = run(4, 1, load)
    assert n == 4
    # the new ones are not ready: the load still sits on the first one, the count stays
    more, _, n2, _ = run(3, n, load, state, t, ready=1)
    assert [d.action for d in more] == [HOLD] * 3 and n2 == n


def test_a_scale_down_waits_for_the_cool_down_drains_the_highest_ordinal_then_removes_it() -> None:
    _, state, n, t = run(4, 1, 2.5 * CAPACITY)
    assert n == 4
    low = 0.5 * CAPACITY
    decisions, state, n, t = run(9, 4, low, state, t)  # 270 s < the 300 s cool-down since the scale-up
    assert all(d.action == HOLD for d in decisions) and decisions[-1].kind in ("cooldown", "stabilizing")
    d = decide({"decode": obs(4, low)}, state, SETTINGS, t + INTERVAL).roles["decode"]
    assert d.action == DRAIN and d.drain == ("flash-decode-3",) and d.target == 3  # maxUnavailable 1 at a time
    state = decide({"decode": obs(4, low)}, state, SETTINGS, t + INTERVAL).state
    # still serving: wait; idle: the count drops
    busy = decide({"decode": obs(4, low, busy={3: 2})}, state, SETTINGS, t + 2 * INTERVAL)
    assert busy.roles["decode"].action == WAIT
    done = decide({"decode": obs(4, low, busy={3: 0})}, busy.state, SETTINGS, t + 3 * INTERVAL)
    assert done.roles["decode"].action == SCALE_DOWN and done.roles["decode"].target == 3
    # then on down, a replica at a time, to what the load needs (min 1)
    decisions, state, n, _ = run(10, 3, low, done.state, t + 3 * INTERVAL)
    assert n == 1


def test_a_drain_that_does_not_end_is_cut_at_the_timeout() -> None:
    state = PlannerState()
    state = replace(state, roles={"decode": replace(state.role("decode"), drain=None)})
    _, state, n, t = run(10, 2, 0.1 * CAPACITY)  # the cool-down from the start ends at the next round
    d = decide({"decode": obs(2, 0.1 * CAPACITY)}, state, SETTINGS, t + INTERVAL)
    assert d.roles["decode"].action == DRAIN
    late = decide({"decode": obs(2, 0.1 * CAPACITY, busy={1: 3})}, d.state, SETTINGS, t + INTERVAL + 61)
    assert late.roles["decode"].action == SCALE_DOWN and "timeout" in late.roles["decode"].reason


def test_no_scale_down_while_the_watchdog_remediates_or_the_budget_is_used() -> None:
    _, state, _, t = run(10, 3, 0.1 * CAPACITY)
    rem = decide({"decode": obs(3, 0.1 * CAPACITY, remediating=("flash-decode-0",))}, state, SETTINGS, t + INTERVAL)
    assert rem.roles["decode"].action == HOLD and rem.roles["decode"].kind == "remediation"
    unready = decide({"decode": obs(3, 0.1 * CAPACITY, ready=2)}, state, SETTINGS, t + INTERVAL)
    assert unready.roles["decode"].action == HOLD and unready.roles["decode"].kind == "budget"


def test_a_paused_role_holds_and_its_model_still_learns() -> None:
    d = decide({"decode": obs(1, 3 * CAPACITY, paused="a rollout is in progress")}, PlannerState(), SETTINGS, 30.0)
    r = d.roles["decode"]
    assert (r.action, r.kind) == (HOLD, "paused") and "rollout" in r.message()
    assert d.state.models.decode.fit.weight > 0


def test_bounds_min_max_and_an_unplanned_role() -> None:
    d = decide({"decode": obs(0, 0.0)}, PlannerState(), SETTINGS, 30.0).roles["decode"]
    assert (d.action, d.target) == (SCALE_UP, 1)
    big = replace(SETTINGS, max_replicas={"prefill": 8, "decode": 3})
    over = decide({"decode": obs(5, 0.0)}, PlannerState(), big, 30.0).roles["decode"]
    assert over.action == DRAIN and over.target == 4  # above maxReplicas: down at once, one at a time
    assert decide({"decode": obs(1, 10 * CAPACITY, planned=False)}, PlannerState(), SETTINGS, 30.0).roles == {}


def test_dry_run_decides_and_changes_no_state() -> None:
    dry = replace(SETTINGS, dry_run=True)
    _, state, _, t = run(10, 3, 0.1 * CAPACITY, settings=dry)
    d = decide({"decode": obs(3, 0.1 * CAPACITY)}, state, dry, t + INTERVAL)
    assert d.roles["decode"].action == DRAIN and d.roles["decode"].dry_run
    assert d.state.role("decode").drain is None and d.roles["decode"].message().startswith("dry run")


def test_hysteresis_a_load_at_a_boundary_does_not_flap() -> None:
    # a noisy load a little above what one replica serves at 80%: up to 2 once, never back
    state, n, t, actions = PlannerState(), 1, 0.0, []
    for i in range(40):
        t += INTERVAL
        d = decide({"decode": obs(n, CAPACITY * (0.95 if i % 2 else 1.05))}, state, SETTINGS, t)
        state, dec = d.state, d.roles["decode"]
        actions.append(dec.action)
        n = dec.target if dec.action in (SCALE_UP, SCALE_DOWN) else n
    assert n == 2 and actions.count(SCALE_UP) == 1 and DRAIN not in actions, actions


def test_a_burst_within_the_reserve_asks_for_no_replica() -> None:
    reserve = replace(SETTINGS, burst_factor=3.0)
    base = 0.5 * CAPACITY
    decisions, state, n, t = run(30, 1, base, settings=reserve)
    # capacity for 3x the baseline, at the targets, as the model sees one replica's capacity
    assert (
        n
        == math.ceil(3 * base / decisions[-1].numbers["capacity_per_replica"] - 1e-9)
        >= math.ceil(3 * base / CAPACITY)
    )
    # its first intervals: the baseline takes at most a 10% step an interval, so a longer burst
    # lifts the reserve by that much each interval (the price of following a fast day's rise)
    burst, _, n2, _ = run(2, n, 2.5 * base, state, t, settings=reserve)
    assert n2 == n and all(d.action == HOLD for d in burst)
    beyond, _, n3, _ = run(2, n, 6 * base, state, t, settings=reserve)
    assert n3 > n  # a load past the reserve is sized as any other


def test_closed_loop_on_a_simulated_fleet_step_up_and_down() -> None:
    """The planner driving the bench simulator's engines (calibrated from bench/results) on a load
    step: it scales decode up, then back down once the cool-down allows, losing no request."""
    from bench.harness import fleet_sim
    from bench.suites import planner_sim

    timing = fleet_sim.calibrate()
    spec = fleet_sim.TraceSpec(
        minutes=16, trough_rps=0.4, peak_ratio=1.0, bursts=((3.0, 5.0),), burst_ratio=4.0, seed=3
    )
    trace = fleet_sim.make_trace(spec)
    settings = Settings(
        interval_s=15,
        ttft_target_s=3,
        itl_target_s=0.06,
        scale_down_cooldown_s=120,
        startup_s=60,
        drain_timeout_s=60,
        max_unavailable={"prefill": 2, "decode": 2},
    )
    r = planner_sim.simulate(planner_sim.Planner(settings, {"prefill": 1, "decode": 1}), trace, timing, spec, 3, 0.06)
    decode = [c[2] for c in r["counts"]]
    assert max(decode) >= 3 and decode[-1] < max(decode), decode
    assert r["unfinished"] == 0
    assert any(d["action"] == DRAIN for d in r["decisions"]) and any(d["action"] == SCALE_UP for d in r["decisions"])


def test_the_baseline_follows_a_day_rising_8_percent_an_interval() -> None:
    """The reserve is sized on the baseline: one that lags a fast day (a compressed day's decode
    load rises up to ~12%/minute as the mix turns reasoning-heavy) leaves the reserve short when
    a burst comes. After 12 intervals of +8% each it is within 10% of the load."""
    from dsv4_operator.planner.decision import baseline

    state, t, load = PlannerState(), 0.0, 0.2 * CAPACITY
    for _ in range(12):
        t += INTERVAL
        load *= 1.08
        state = decide({"decode": obs(8, load)}, state, replace(SETTINGS, burst_factor=3.0), t).state
    assert baseline(state.role("decode")) >= 0.9 * load, (baseline(state.role("decode")), load)


def test_a_known_burst_free_load_sizes_the_reserve() -> None:
    """decide() takes each role's load without bursts where the caller knows it (the planner's
    benchmark bounds a perfect burst filter so): the reserve is burstFactor x that load, whatever
    the demand did, and a burst in the demand lifts nothing."""
    settings = replace(SETTINGS, burst_factor=3.0)
    known = 0.5 * CAPACITY
    state, t, n = PlannerState(), 0.0, 1
    for i in range(12):  # a burst of 2.5x the known load from the 6th interval on
        t += INTERVAL
        load = known * (2.5 if i >= 6 else 1.0)
        d = decide({"decode": obs(n, load)}, state, settings, t, burst_free={"decode": known})
        state, dec = d.state, d.roles["decode"]
        n = dec.target if dec.action in (SCALE_UP, SCALE_DOWN) else n
        assert dec.numbers["reserve"] == pytest.approx(3.0 * known, rel=0.01), (i, dec.numbers["reserve"])
    assert n == math.ceil(3.0 * known / dec.numbers["capacity_per_replica"] - 1e-9)
    # without it, the same burst lifts the baseline (by up to 10% an interval) and the reserve with it
    state, t = PlannerState(), 0.0
    for i in range(12):
        t += INTERVAL
        d = decide({"decode": obs(n, known * (2.5 if i >= 6 else 1.0))}, state, settings, t)
        state = d.state
    assert d.roles["decode"].numbers["reserve"] > 1.3 * 3.0 * known
