"""The wedge detector on synthetic series: what is Wedged, and (above all) what never is."""

import random

import pytest

from dsv4_operator.watchdog.detector import (
    Detector,
    Healthy,
    Slow,
    Unreachable,
    Wedged,
    verdict_to_dict,
)
from dsv4_operator.watchdog.signals import BUILTIN, SGLANG, EngineSample

WINDOW = 120.0
STEP = 5.0


def sample(t, role="prefill", kind=BUILTIN, **kw):
    return EngineSample(timestamp=float(t), role=role, reachable=True, kind=kind, **kw)


def run(series, detector=None, pod="pod-0"):
    """Feed a series; return [(t, verdict)]."""
    det = detector or Detector(window_s=WINDOW, failure_rate_threshold=0.5)
    return [(s.timestamp, det.observe(pod, s)) for s in series]


def first_wedged(results):
    return next(((t, v) for t, v in results if isinstance(v, Wedged)), None)


def never_wedged(results):
    bad = [(t, v) for t, v in results if isinstance(v, Wedged)]
    assert not bad, f"wedged at {bad[0]}"


def builtin_prefill(t, **kw):
    base = dict(
        num_running=0,
        num_queue=0,
        bootstrap_queue=0,
        prefill_inflight=0,
        prefill_inflight_oldest_age_seconds=0.0,
        transfers_completed=0.0,
        transfer_bytes=0.0,
        transfer_failed=0.0,
        transfer_timeout=0.0,
        generation_tokens=0.0,
        prompt_tokens=0.0,
        loop_iterations=t * 10,
    )
    base.update(kw)
    return sample(t, "prefill", **base)


def times(duration, start=0.0, step=STEP):
    n = int(duration / step) + 1
    return [start + i * step for i in range(n)]


# --- the wedge itself ----------------------------------------------------------------------------


def incident_prefill_series(duration=600.0, stuck_from=100.0):
    """The incident: the prefill keeps computing (loop and prompt tokens grow, new requests keep
    arriving) but one transfer never completes nor fails; later ones pile up behind it."""
    out = []
    for t in times(duration):
        if t < stuck_from:
            out.append(
                builtin_prefill(
                    t,
                    prefill_inflight=1,
                    transfers_completed=t // 5,
                    transfer_bytes=(t // 5) * 4096,
                    prefill_inflight_oldest_age_seconds=1.0,
                    prompt_tokens=t * 100,
                )
            )
        else:
            out.append(
                builtin_prefill(
                    t,
                    prefill_inflight=1 + (t - stuck_from) // 30,
                    transfers_completed=stuck_from // 5,
                    transfer_bytes=(stuck_from // 5) * 4096,
                    prefill_inflight_oldest_age_seconds=t - stuck_from + 1.0,
                    prompt_tokens=t * 100,
                    num_running=1,
                )
            )
    return out


def test_stuck_inflight_detected_after_window_not_before():
    results = run(incident_prefill_series(stuck_from=100.0))
    t, v = first_wedged(results)
    assert v.reason == "stuck_inflight"
    # Stuck from t=100 (last completion at 95); Wedged once the window has passed, within a step.
    assert 100 + WINDOW - STEP <= t <= 100 + WINDOW + STEP
    assert v.details["oldest_inflight_age_seconds"] >= WINDOW
    before = [v for tt, v in results if tt < t]
    assert not any(isinstance(x, Wedged) for x in before)
    # In between it reads Slow: the hand-off has waited longer than usual.
    assert any(isinstance(x, Slow) and x.reason == "handoff_slow" for x in before)
    # And it stays Wedged while nothing changes.
    assert all(isinstance(v, Wedged) for tt, v in results if tt >= t)


def test_wedge_needs_age_beyond_window_when_engine_exports_age():
    # Inflight > 0 and no completions for the window, but the oldest request keeps changing
    # (age stays low): requests are moving (e.g. failing fast on deadlines).  Not stuck.
    series = [
        builtin_prefill(t, prefill_inflight=2, transfers_completed=10, prefill_inflight_oldest_age_seconds=(t % 20) + 1)
        for t in times(600)
    ]
    never_wedged(run(series))


def test_age_never_reaching_window_is_not_wedged_even_if_flat():
    # A stale age gauge far below the window cannot prove a stuck request.
    series = [
        builtin_prefill(t, prefill_inflight=1, transfers_completed=10, prefill_inflight_oldest_age_seconds=30.0)
        for t in times(600)
    ]
    never_wedged(run(series))


def test_sglang_prefill_wedge_without_age_signal():
    # SGLang exports no oldest age: inflight > 0 (live, from /v1/loads) and no completed
    # transfer for the window is enough.
    series = [
        sample(
            t,
            "prefill",
            SGLANG,
            prefill_inflight=1,
            num_running=0,
            num_queue=0,
            transfers_completed=40.0,
            transfer_failed=31.0,
            prompt_tokens=9e4,
        )
        for t in times(400)
    ]
    t, v = first_wedged(run(series))
    assert v.reason == "stuck_inflight" and WINDOW <= t <= WINDOW + STEP


def test_no_progress_signal_at_all_is_never_wedged():
    # Neither a completion counter nor an age: no evidence either way, so no verdict beyond Slow.
    series = [sample(t, "prefill", SGLANG, prefill_inflight=1) for t in times(600)]
    results = run(series)
    never_wedged(results)
    assert isinstance(results[-1][1], Slow)


def test_decode_stuck_transfer():
    series = [
        sample(
            t,
            "decode",
            decode_transfer=2,
            num_running=0,
            transfers_completed=5.0,
            generation_tokens=800.0,
            loop_iterations=t,
        )
        for t in times(400)
    ]
    t, v = first_wedged(run(series))
    assert v.reason == "stuck_transfer" and v.details["role"] == "decode"


def test_scheduler_stalled_with_work():
    series = [
        builtin_prefill(t, num_running=2, num_queue=5, loop_iterations=777.0, prompt_tokens=5000.0) for t in times(400)
    ]
    t, v = first_wedged(run(series))
    assert v.reason == "scheduler_stalled" and WINDOW <= t <= WINDOW + STEP


def test_stale_sglang_gauges_never_prove_a_stall():
    # SGLang gauges keep their last value when idle; with no loop counter, no stall verdict.
    series = [
        sample(t, "decode", SGLANG, num_running=3, num_queue=0, generation_tokens=100.0, decode_transfer=0)
        for t in times(900)
    ]
    never_wedged(run(series))


# --- slow is not wedged ----------------------------------------------------------------------------


def test_long_prefill_never_wedged():
    # One huge prompt: running for 15 minutes, queue behind it, loop iterating, nothing inflight.
    series = [
        builtin_prefill(t, num_running=1, num_queue=6, prompt_tokens=t * 50, loop_iterations=t * 3) for t in times(900)
    ]
    results = run(series)
    never_wedged(results)
    assert all(isinstance(v, Healthy) for _, v in results)


def test_long_prefill_with_slow_chunks_never_wedged():
    # Each chunk takes 60 s: the loop counter moves only once a minute (< window).
    series = [
        builtin_prefill(t, num_running=1, num_queue=2, loop_iterations=t // 60, prompt_tokens=(t // 60) * 8192)
        for t in times(900)
    ]
    never_wedged(run(series))


def test_busy_decode_never_wedged():
    # Always some requests waiting for KV, always many decoding; transfers complete.
    rnd = random.Random(7)
    series = [
        sample(
            t,
            "decode",
            num_running=64,
            num_queue=3,
            decode_prealloc=rnd.randint(1, 9),
            decode_transfer=rnd.randint(1, 6),
            transfers_completed=t * 2,
            generation_tokens=t * 1000,
            loop_iterations=t * 30,
        )
        for t in times(900)
    ]
    never_wedged(run(series))


def test_busy_sglang_decode_never_wedged_even_without_transfer_counter():
    # SGLang counts transfers on the prefill side: on decode the counter reads 0 forever.
    series = [
        sample(
            t, "decode", SGLANG, num_running=64, decode_transfer=3, transfers_completed=0.0, generation_tokens=t * 1000
        )
        for t in times(900)
    ]
    never_wedged(run(series))


def test_inflight_with_transfers_completing_never_wedged():
    # Heavy prefill load: inflight never empties, but transfers complete every 10 s and the
    # oldest request keeps changing.
    series = [
        builtin_prefill(
            t,
            prefill_inflight=4,
            num_running=2,
            num_queue=10,
            transfers_completed=t // 10,
            prefill_inflight_oldest_age_seconds=(t % 10) + 0.5,
            prompt_tokens=t * 100,
        )
        for t in times(900)
    ]
    results = run(series)
    never_wedged(results)
    assert all(isinstance(v, Healthy) for _, v in results)


def test_transfers_completing_slowly_but_within_window_never_wedged():
    # One completion every 100 s (< 120 s window) while inflight > 0 throughout.
    series = [
        builtin_prefill(
            t, prefill_inflight=3, transfers_completed=t // 100, prefill_inflight_oldest_age_seconds=(t % 100) + 1
        )
        for t in times(900)
    ]
    never_wedged(run(series))


def test_one_slow_huge_transfer_moving_bytes_never_wedged():
    # A 1M-token context's KV takes 5 minutes to move: no completion, age beyond the window,
    # but bytes keep flowing.
    series = [
        builtin_prefill(
            t,
            prefill_inflight=1,
            transfers_completed=3.0,
            transfer_bytes=t * 1e8,
            prefill_inflight_oldest_age_seconds=t + 1,
        )
        for t in times(300)
    ]
    results = run(series)
    never_wedged(results)
    assert isinstance(results[-1][1], Slow)


def test_idle_engines_healthy():
    for role in ("prefill", "decode", "mono"):
        series = [
            sample(
                t,
                role,
                num_running=0,
                num_queue=0,
                prefill_inflight=0,
                decode_transfer=0,
                transfers_completed=5.0,
                loop_iterations=100.0,
            )
            for t in times(600)
        ]
        assert all(isinstance(v, Healthy) for _, v in run(series))


def _progressing_series(rnd, role, duration=900.0):
    """Random busy-but-progressing load: every gap between hand-off progress is shorter than
    the window; compute always moves; failures rare."""
    t, out = 0.0, []
    completed = failed = tokens = loops = 0.0
    last_progress = 0.0
    age = 0.0
    while t <= duration:
        pending = rnd.randint(0, 8)
        progress_due = t - last_progress >= rnd.uniform(10, WINDOW * 0.8)
        if pending == 0 or progress_due or rnd.random() < 0.4:
            completed += rnd.randint(1, 5)
            last_progress = t
            age = rnd.uniform(0, 5)
        else:
            age += STEP
        if rnd.random() < 0.05:
            failed += 1
        tokens += rnd.randint(1, 5000)
        loops += rnd.randint(1, 300)
        kw = dict(
            num_running=rnd.randint(0, 64),
            num_queue=rnd.randint(0, 30),
            transfers_completed=completed,
            transfer_failed=failed,
            transfer_timeout=0.0,
            generation_tokens=tokens,
            prompt_tokens=tokens * 3,
            loop_iterations=loops,
        )
        if role == "prefill":
            kw.update(prefill_inflight=pending, prefill_inflight_oldest_age_seconds=age if pending else 0.0)
        else:
            kw.update(decode_transfer=pending, decode_prealloc=rnd.randint(0, 5))
        out.append(sample(t, role, **kw))
        t += rnd.choice([STEP, STEP, STEP * 2, STEP * 0.5])
    return out


@pytest.mark.parametrize("seed", range(60))
def test_random_progressing_load_never_wedged(seed):
    rnd = random.Random(seed)
    for role in ("prefill", "decode"):
        never_wedged(run(_progressing_series(rnd, role)))


# --- transfer failures ----------------------------------------------------------------------------


def test_failure_rate_above_threshold():
    series = [
        builtin_prefill(t, transfers_completed=t // 5, transfer_failed=2 * (t // 5), transfer_timeout=0.0)
        for t in times(100)
    ]
    t, v = first_wedged(run(series))
    assert v.reason == "transfer_failures"
    assert v.details["failure_rate"] > 0.5 and v.details["failed_transfers"] >= 3
    assert t <= 3 * STEP  # a burst needs no full window, only the minimum count


def test_timeouts_count_as_failures():
    series = [
        builtin_prefill(t, transfers_completed=0.0, transfer_failed=0.0, transfer_timeout=t // 5) for t in times(60)
    ]
    assert first_wedged(run(series))[1].reason == "transfer_failures"


def test_failure_rate_below_threshold_not_wedged():
    series = [builtin_prefill(t, transfers_completed=3 * (t // 5), transfer_failed=t // 5) for t in times(600)]
    never_wedged(run(series))


def test_few_failures_below_minimum_are_slow_not_wedged():
    series = [builtin_prefill(t, transfers_completed=0.0, transfer_failed=min(t // 50, 2)) for t in times(400)]
    results = run(series)
    never_wedged(results)
    assert any(isinstance(v, Slow) and v.reason == "transfer_failures" for _, v in results)


def test_old_failures_leave_the_window():
    # 10 failures early, then 10 minutes of clean transfers: Healthy again.
    series = [builtin_prefill(t, transfers_completed=t, transfer_failed=min(t, 10.0)) for t in times(900, step=1.0)]
    results = run(series)
    assert isinstance(results[-1][1], Healthy)


# --- reachability ---------------------------------------------------------------------------------


def down(t, role="prefill", error="connect refused"):
    return EngineSample(timestamp=float(t), role=role, reachable=False, error=error)


def test_unreachable_then_unresponsive_after_window():
    series = [builtin_prefill(t) for t in times(50)] + [down(t) for t in times(200, start=55)]
    results = run(series)
    t, v = first_wedged(results)
    assert v.reason == "unresponsive"
    assert 50 + WINDOW <= t <= 50 + WINDOW + STEP  # silent since the last answer at t=50
    assert all(isinstance(v, Unreachable) and v.since == 55 for tt, v in results if 55 <= tt < t)


def test_never_reachable_pod_is_never_wedged():
    results = run([down(t) for t in times(900)])
    assert all(isinstance(v, Unreachable) for _, v in results)


def test_silent_from_the_start_but_known_to_have_served():
    # The operator restarted while an engine was already hung: its pod had been Ready.
    det = Detector(window_s=WINDOW)
    results = [(t, det.observe("p", down(t), answered_before=True)) for t in times(300)]
    t, v = first_wedged(results)
    assert v.reason == "unresponsive" and t == WINDOW


def test_reachable_again_clears_unreachable():
    det = Detector(window_s=WINDOW)
    run([builtin_prefill(t) for t in times(50)], det)
    run([down(t) for t in times(60, start=55)], det)
    assert isinstance(det.observe("pod-0", builtin_prefill(120)), Healthy)
    # A new silence is measured from the last answer, not the first outage.
    assert isinstance(det.observe("pod-0", down(125)), Unreachable)
    assert isinstance(det.observe("pod-0", down(125 + WINDOW)), Wedged)


# --- restarts and ordering ------------------------------------------------------------------------


def test_restarted_engine_starts_a_fresh_window():
    det = Detector(window_s=WINDOW)
    stuck = [
        builtin_prefill(
            t,
            prefill_inflight=1,
            transfers_completed=50.0,
            transfer_failed=20.0,
            loop_iterations=1e6 + t,
            prefill_inflight_oldest_age_seconds=t + 1,
        )
        for t in times(100)
    ]
    run(stuck, det)
    # Restart at t=105: counters back near zero; a new request is inflight right away.
    after = [
        builtin_prefill(
            t,
            prefill_inflight=1,
            transfers_completed=0.0,
            transfer_failed=0.0,
            loop_iterations=t - 105,
            prefill_inflight_oldest_age_seconds=t - 104,
        )
        for t in times(200, start=105)
    ]
    results = run(after, det)
    t, v = first_wedged(results)
    assert t >= 105 + WINDOW  # the 100 s before the restart did not count


def test_counter_reset_is_not_a_failure_burst_nor_progress():
    det = Detector(window_s=WINDOW)
    series = [
        builtin_prefill(t, transfers_completed=1000 + t, transfer_failed=25.0, generation_tokens=1e5 + t)
        for t in times(100)
    ]
    series += [
        builtin_prefill(t, transfers_completed=t - 105, transfer_failed=0.0, generation_tokens=t)
        for t in times(300, start=105)
    ]
    results = run(series, det)
    never_wedged(results)
    assert all(isinstance(v, Healthy) for _, v in results)


def test_late_or_duplicate_samples_ignored():
    det = Detector(window_s=WINDOW)
    run(incident_prefill_series(duration=300, stuck_from=0.0), det)
    old = builtin_prefill(10.0, prefill_inflight=0, transfers_completed=999.0)
    assert isinstance(det.observe("pod-0", old), Wedged)


def test_pods_are_independent_and_forget_works():
    det = Detector(window_s=WINDOW)
    for s in incident_prefill_series(duration=400, stuck_from=0.0):
        det.observe("a", s)
        det.observe("b", builtin_prefill(s.timestamp, transfers_completed=s.timestamp))
    last = builtin_prefill(
        401,
        prefill_inflight=14,
        transfers_completed=0.0,
        num_running=1,
        prefill_inflight_oldest_age_seconds=402,
        prompt_tokens=40100,
    )
    assert isinstance(det.observe("a", last), Wedged)
    assert isinstance(det.observe("b", builtin_prefill(401, transfers_completed=401)), Healthy)
    det.forget("a")
    assert sorted(det.pods()) == ["b"]


def test_window_memory_is_bounded():
    det = Detector(window_s=WINDOW)
    for t in times(3_000, step=1.0):
        det.observe("p", builtin_prefill(t))
    assert len(det._pods["p"].samples) <= WINDOW + 2


def test_verdict_to_dict_json_ready():
    assert verdict_to_dict(Healthy()) == {"state": "Healthy"}
    d = verdict_to_dict(Wedged("stuck_inflight", {"x": 1}))
    assert d == {"state": "Wedged", "reason": "stuck_inflight", "details": {"x": 1}}
    assert verdict_to_dict(Unreachable(5.0, "boom")) == {"state": "Unreachable", "since": 5.0, "error": "boom"}


def test_invalid_settings_rejected():
    with pytest.raises(ValueError):
        Detector(window_s=0)
    with pytest.raises(ValueError):
        Detector(failure_rate_threshold=1.5)
