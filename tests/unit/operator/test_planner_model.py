"""The planner's performance model (dsv4_operator.planner.model), forecast and observation parsing:
pure functions, no I/O."""

from __future__ import annotations

import math
import random

import pytest

from dsv4_engine.step_tally import StepTally
from dsv4_operator.planner.forecast import Holt
from dsv4_operator.planner.model import (
    CORRECTION_BOUNDS,
    Fit,
    TTFT_TAIL,
    RoleModel,
    decode_capacity,
    decode_features,
    prefill_capacity,
    prefill_service_s,
    queueing_ttft_s,
    smoothed_ratio,
    steps_observation,
)
from dsv4_operator.planner.observe import Reading, engine_load, reading, scan_metrics

TRUE_DECODE = (0.012, 0.0009, 3e-7)  # a, b, c of a made-up engine


def decode_interval(rng: random.Random, batch: int, context: float) -> dict:
    """Step totals of one interval of an engine whose steps follow TRUE_DECODE (with noise)."""
    a, b, c = TRUE_DECODE
    steps = rng.randint(200, 400)
    seconds = sum((a + b * batch + c * batch * context) * math.exp(rng.gauss(0, 0.05)) for _ in range(steps))
    return {
        "steps": steps,
        "seconds": seconds,
        "requests": steps * batch,
        "tokens": steps * batch,
        "request_context": steps * batch * context,
    }


def test_the_fit_recovers_a_decode_step_from_interval_totals() -> None:
    rng = random.Random(0)
    fit = RoleModel.decode().fit
    for _ in range(60):  # a day of varied batches and contexts
        totals = decode_interval(rng, rng.choice([1, 4, 8, 16, 32, 64]), rng.uniform(200, 4000))
        features, step_s, steps = steps_observation(totals, "decode")
        fit = fit.update(features, step_s, steps)
    for batch, context in ((1, 500), (16, 2000), (64, 3000)):
        truth = TRUE_DECODE[0] + TRUE_DECODE[1] * batch + TRUE_DECODE[2] * batch * context
        assert fit.predict(decode_features(batch, context)) == pytest.approx(truth, rel=0.08)


def test_an_unexcited_direction_keeps_its_prior_and_nonsense_is_ignored() -> None:
    fit = Fit.prior((0.02, 0.001, 1e-7), (0.05, 0.002, 1e-6))
    same = fit
    for bad in (math.nan, -1.0, 0.0, math.inf):
        same = same.update((1.0, 8.0, 8000.0), bad, 10)
    assert same == fit
    # only batch 8 seen: the prediction there is learnt, the spread elsewhere never beyond the prior's
    for _ in range(50):
        fit = fit.update((1.0, 8.0, 8000.0), 0.05, 50)
    assert fit.predict((1.0, 8.0, 8000.0)) == pytest.approx(0.05, rel=0.02)
    assert all(fit.cov[i][i] <= fit.prior_cov[i][i] * (1 + 1e-9) for i in range(3))


def test_decode_capacity_is_bound_by_the_itl_target_the_kv_cache_or_the_batch_limit() -> None:
    model = RoleModel(Fit.prior(TRUE_DECODE, (1e-9,) * 3))
    a, b, c = TRUE_DECODE
    itl = decode_capacity(model, 0.05, context=1000)
    assert itl.bound == "itl"
    assert itl.batch == pytest.approx((0.05 - a) / (b + c * 1000))
    assert itl.itl_s == pytest.approx(0.05)
    assert itl.tokens_per_s == pytest.approx(itl.batch / 0.05)
    kv = decode_capacity(model, 0.05, context=1000, kv_tokens=10_000)
    assert (kv.bound, kv.batch) == ("kv", pytest.approx(10.0))
    capped = decode_capacity(model, 0.05, context=1000, max_batch=4)
    assert (capped.bound, capped.batch) == ("max_batch", 4.0)
    # A correction of 2 (the engines measure twice the model's ITL) halves what fits the target.
    corrected = decode_capacity(RoleModel(model.fit, 2.0), 0.05, context=1000)
    assert corrected.batch == pytest.approx((0.025 - a) / (b + c * 1000))
    assert decode_capacity(model, a / 2, context=1000).bound == "none"  # the target is below one step


def test_prefill_capacity_and_the_queueing_limit_meet_the_ttft_target() -> None:
    model = RoleModel(Fit.prior((0.02, 1e-4, 1e-8), (1e-9,) * 3))
    cap = prefill_capacity(model, ttft_target_s=1.0, prompt_len=2000, max_batched_tokens=8192)
    step = 0.02 + 1e-4 * 8192 + 1e-8 * 8192 * 2000
    assert cap.tokens_per_s == pytest.approx(8192 / step)
    assert cap.service_s == pytest.approx(prefill_service_s(model, 2000))
    # at the utilization allowed, the queueing model's 90th percentile TTFT is the target
    assert queueing_ttft_s(cap.service_s, cap.max_utilization, TTFT_TAIL) == pytest.approx(1.0)
    assert queueing_ttft_s(cap.service_s, cap.max_utilization) < 1.0  # the mean is below it
    assert prefill_capacity(model, ttft_target_s=cap.service_s / 2, prompt_len=2000).max_utilization == 0.0
    # long prompts of varied length: a token's context above the mean prompt costs throughput
    assert prefill_capacity(model, 1.0, 2000, 8192, context=3000).tokens_per_s < cap.tokens_per_s


def test_the_correction_follows_the_measured_latency_within_bounds() -> None:
    k = 1.0
    for _ in range(30):
        k = smoothed_ratio(k, 0.06, 0.04)
    assert k == pytest.approx(1.5, rel=0.01)
    assert smoothed_ratio(1.0, None, 0.04) == 1.0
    for _ in range(60):
        k = smoothed_ratio(k, 100.0, 0.01)
    assert k == pytest.approx(CORRECTION_BOUNDS[1])


def test_holt_follows_a_trend_and_damps_it_ahead() -> None:
    h = Holt()
    assert h.forecast(3) == 0.0
    for v in range(10, 200, 10):
        h = h.observe(v)
    assert 190 < h.forecast(1) < 215
    assert h.forecast(1) < h.forecast(5) < 190 + 10 * 5  # a rise, damped
    assert Holt().observe(-5).forecast(2) == 0.0


def test_step_tally_kinds_and_sums() -> None:
    class Seq:
        def __init__(self, computed: int) -> None:
            self.num_computed = computed

    class Item:
        def __init__(self, new: int, computed: int) -> None:
            self.num_new, self.seq = new, Seq(computed)

    t = StepTally()
    t.record([Item(1, 99), Item(1, 9)], 0.02)  # decode: contexts 100 and 10
    t.record([Item(64, 0), Item(32, 64)], 0.1)  # prefill chunks
    t.record([Item(1, 5), Item(16, 0)], 0.05)  # mixed
    t.record([], 1.0)
    d = t.as_dict()
    assert d["decode"] == {
        "steps": 1,
        "seconds": 0.02,
        "requests": 2,
        "tokens": 2,
        "request_context": 110,
        "token_context": 110,
    }
    assert d["prefill"]["tokens"] == 96 and d["prefill"]["token_context"] == 64 * 64 + 32 * 96
    assert d["mixed"]["steps"] == 1


METRICS = """# HELP dsv4:num_running_reqs x
# TYPE dsv4:num_running_reqs gauge
dsv4:num_running_reqs{model_name="m",role="decode",tp_rank="0"} 3
dsv4:num_running_reqs{model_name="m",role="decode",tp_rank="1"} 2
dsv4:inter_token_latency_seconds_sum{model_name="m",role="decode"} 12.5
dsv4:inter_token_latency_seconds_count{model_name="m",role="decode"} 500
dsv4:generation_tokens_total{model_name="m",role="decode"} 900
dsv4:time_to_first_token_seconds_sum{role="decode"} NaN
garbage line
dsv4:kv_pages_total 100
"""


def test_scan_metrics_sums_label_sets_and_skips_what_does_not_parse() -> None:
    m = scan_metrics(METRICS)
    assert m == {"running": 5.0, "itl_sum": 12.5, "itl_count": 500.0, "generation_tokens": 900.0, "kv_pages_total": 100}
    sg = scan_metrics('sglang:num_used_tokens{a="b"} 4096\nsglang:max_total_num_tokens 65536\n', "sglang")
    assert sg == {"kv_used_tokens": 4096.0, "kv_pages_total": 65536.0}


def test_an_interval_of_an_engine_from_two_readings() -> None:
    loads = {
        "queues": {"waiting": 1, "running": 4, "prealloc": 2, "transfer": 0},
        "kv_pages_free": 60,
        "kv_pages_total": 100,
        "kv_page_size": 16,
        "counters": {"prompt_tokens": 1000.0, "generation_tokens": 500.0},
        "queued_prompt_tokens": 300,
        "running_context_tokens": 800,
        "max_num_seqs": 64,
        "steps": {"decode": {"steps": 100, "seconds": 2.0, "requests": 400, "tokens": 400, "request_context": 8e4}},
    }
    first = reading(10.0, loads, METRICS)
    assert (first.running, first.waiting, first.kv_tokens_total, first.kv_tokens_used) == (4, 3, 1600, 640)
    later = {
        **loads,
        "counters": {"prompt_tokens": 3000.0, "generation_tokens": 2500.0},
        "steps": {"decode": {"steps": 300, "seconds": 6.0, "requests": 1200, "tokens": 1200, "request_context": 2.4e5}},
    }
    second = reading(20.0, later, METRICS.replace("12.5", "22.5").replace(" 500\n", " 1000\n"))
    load = engine_load("d-0", "decode", first, second)
    assert load.seconds == 10.0
    assert load.prompt_tokens_per_s == 200.0 and load.generation_tokens_per_s == 200.0
    assert load.itl_s == pytest.approx(10.0 / 500) and load.itl_n == 500
    assert load.context == 200.0
    assert load.steps["decode"]["steps"] == 200 and load.steps["decode"]["seconds"] == 4.0
    # A counter that went down: the engine restarted; no rate from that pair.
    restarted = engine_load("d-0", "decode", second, Reading(time=30.0, generation_tokens=10.0))
    assert restarted.generation_tokens_per_s is None
    assert engine_load("d-0", "decode", None, first).seconds == 0.0
