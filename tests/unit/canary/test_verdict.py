"""The canary's verdict and its replayed conversation, without I/O."""

from __future__ import annotations

import pytest

from dsv4_operator.canary.conversation import ConversationShape, context_target, rounds
from dsv4_operator.canary.verdict import CanaryThresholds, ProbeFigures, WatchdogSignals, judge

STABLE = ProbeFigures(requests=40, ttft_p99_s=0.20, itl_p99_s=0.05, max_context=1000, context_target=1024)
GOOD = ProbeFigures(requests=38, ttft_p99_s=0.30, itl_p99_s=0.08, max_context=1000, context_target=1024)
IDLE = WatchdogSignals(kv_pages_free_before=128, kv_pages_free_after=128, kv_pages_total=128)


def test_a_healthy_canary_passes():
    v = judge(GOOD, STABLE, IDLE)
    assert v.passed and v.reasons == () and v.summary() == "passed"
    assert v.to_dict()["stable"]["ttft_p99_s"] == 0.20


@pytest.mark.parametrize(
    "change,signals,says",
    [
        ({"stalled": 2, "max_context": 400}, IDLE, "no answer within the request timeout"),
        ({"errors": 1, "first_error": "HTTP 500: boom"}, IDLE, "HTTP 500: boom"),
        ({}, WatchdogSignals(wedged="no_progress"), "wedged (no_progress)"),
        ({}, WatchdogSignals(kv_pages_free_before=128, kv_pages_free_after=120), "8 KV page(s) not given back"),
        ({"max_context": 400}, IDLE, "reached 400 tokens of context on the canary, 1000 on the stable"),
        ({"ttft_p99_s": 0.50}, IDLE, "TTFT p99 500 ms > 2 x stable 200 ms + 50 ms"),
        ({"itl_p99_s": 0.16}, IDLE, "ITL p99 160 ms"),
        ({"requests": 0}, IDLE, "completed no request"),
    ],
)
def test_each_failure_is_a_reason(change, signals, says):
    v = judge(ProbeFigures(**{**GOOD.to_dict(), **change}), STABLE, signals)
    assert not v.passed and any(says in r for r in v.reasons), v.reasons


def test_latency_within_slack_passes():
    # 2 x 10 ms + 50 ms: a canary at 60 ms is within its allowance; ratios of milliseconds are noise
    stable = ProbeFigures(requests=5, ttft_p99_s=0.010, itl_p99_s=0.010, max_context=100)
    assert judge(ProbeFigures(requests=5, ttft_p99_s=0.060, itl_p99_s=0.060, max_context=100), stable, IDLE).passed
    assert not judge(ProbeFigures(requests=5, ttft_p99_s=0.080, itl_p99_s=0.010, max_context=100), stable, IDLE).passed


def test_without_a_stable_measure_the_target_is_the_bar():
    assert judge(GOOD, None, IDLE, CanaryThresholds(min_context_ratio=0.9)).passed
    assert judge(ProbeFigures(**{**GOOD.to_dict(), "max_context": 600}), STABLE, IDLE).passed  # one round fewer
    assert not judge(ProbeFigures(requests=5, max_context=100, context_target=1024), None, IDLE).passed


def test_conversation_grows_by_tool_sized_additions_up_to_its_share():
    shape = ConversationShape(system_tokens=32, growth_tokens=48, answer_tokens=8, max_rounds=100, context_share=0.5)
    rs = rounds(shape, 1024, seed=1)
    assert context_target(shape, 1024) == 512
    assert len(rs[0]) == 32 and all(len(b) - len(a) == 56 for a, b in zip(rs, rs[1:]))
    assert all(b[: len(a)] == a for a, b in zip(rs, rs[1:]))  # each round extends the one before
    assert len(rs[-1]) <= 512 < len(rs[-1]) + 56
    assert rounds(shape, 1024, seed=1) == rs and rounds(shape, 1024, seed=2) != rs  # replayed from its seed
    assert all(2 <= t < shape.vocab for t in rs[-1])


def test_conversation_rounds_are_capped_and_shapes_checked():
    assert len(rounds(ConversationShape(max_rounds=3, growth_tokens=1), 10_000, 0)) == 3
    with pytest.raises(ValueError):
        ConversationShape(context_share=0)
