"""/ready's stall rule: a long step the engine's own pace explains is busy, not hung."""

from dsv4_engine.step_clock import FIRST_STEP_S, FLOOR_S, SLOW_FACTOR, StepClock, step_allowance


def test_between_steps_the_floor_applies():
    assert StepClock().allowance() == FLOOR_S


def test_a_first_step_has_no_pace_to_judge_by():
    c = StepClock()
    c.begin(4096, now=0.0)
    assert c.allowance() == FIRST_STEP_S


def test_a_long_prefill_chunk_is_allowed_what_its_size_explains():
    c = StepClock()
    c.begin(8, now=0.0)
    c.end(now=0.4)  # 20 tokens/s: a slow engine (flash shape on 2 CPU cores)
    c.begin(2048, now=1.0)
    assert c.allowance() == SLOW_FACTOR * 2048 / 20 > 60 * 8
    c.end(now=100.0)
    assert c.allowance() == FLOOR_S  # between steps again


def test_the_slowest_recent_pace_is_used_and_old_ones_leave_the_window():
    c = StepClock(window=2)
    for took in (1.0, 0.01, 0.01):  # 1 tok/s, then 100 tok/s twice: the slow step leaves the window
        c.begin(1, now=0.0)
        c.end(now=took)
    assert c.tokens_per_s == 100.0
    c.begin(1, now=0.0)
    assert c.allowance() == FLOOR_S  # a one-token step at 100 tok/s: the floor


def test_a_hung_step_is_still_caught():
    # A small step at a fast pace: after FLOOR_S it counts as hung, whatever the step.
    assert step_allowance(1, 1000.0) == FLOOR_S
    assert step_allowance(64, None) == FIRST_STEP_S


def test_a_step_without_tokens_or_time_teaches_nothing():
    c = StepClock()
    c.begin(0, now=0.0)
    c.end(now=5.0)
    c.begin(3, now=5.0)
    c.end(now=5.0)
    assert c.tokens_per_s is None
    c.end(now=6.0)  # no step in progress: nothing to end
    assert c.started is None
