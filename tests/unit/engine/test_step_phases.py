"""The per-phase timer of the engine loop (dsv4_engine.step_phases): laps add up to the step,
decode-only steps are kept apart from mixed ones, the greedy tokens do not depend on it, and
/v1/loads carries the breakdown when DSV4_STEP_PHASES is set."""

from __future__ import annotations

import time

import pytest

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence
from dsv4_engine.step_phases import PHASES, StepPhases

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_laps_sum_per_kind_and_idle_steps_are_not_counted():
    t = StepPhases()
    t.lap("x")  # off: nothing recorded
    t.end(True)
    assert t.summary() == {"enabled": False}
    t.enable()
    for decode in (True, True, False):
        t.begin()
        time.sleep(0.002)
        t.lap("a")
        t.decode = decode
        time.sleep(0.001)
        t.lap("b")
        t.end(True)
    t.begin()
    t.lap("a")
    t.end(False)  # no batch ran: not a step
    s = t.summary()
    assert s["decode"]["steps"] == 2 and s["mixed"]["steps"] == 1
    ph = s["decode"]["phases"]
    assert ph["a"]["ms_per_step"] >= 2 and ph["b"]["ms_per_step"] >= 1
    assert abs(ph["a"]["ms_per_step"] + ph["b"]["ms_per_step"] - s["decode"]["ms_per_step"]) < 0.01
    assert abs(ph["a"]["share"] + ph["b"]["share"] - 1) < 0.01


@pytest.mark.parametrize("preset", ["tiny", "v4-tiny"])
def test_engine_steps_report_model_phases_and_tokens_do_not_change(make_model, monkeypatch, preset):
    model = make_model(preset)

    def generate(on: bool) -> tuple[list[list[int]], dict]:
        if on:
            monkeypatch.setenv("DSV4_STEP_PHASES", "1")
        else:
            monkeypatch.delenv("DSV4_STEP_PHASES", raising=False)
        PHASES.enable(False)
        engine = Engine(EngineArgs(model=str(model), device="cpu", kernel_backend="cpu", kv_pages=64, max_num_seqs=4))
        seqs = [
            Sequence(f"r{i}", [5 + i, 6, 7, 8, 9], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
            for i in range(3)
        ]
        for s in seqs:
            s.sink = lambda out: None
            engine._add(s)
        while engine.scheduler.has_work():
            engine.step()
        loads = engine.loads()
        PHASES.enable(False)
        return [s.output_ids for s in seqs], loads

    off_tokens, off_loads = generate(False)
    on_tokens, loads = generate(True)
    assert on_tokens == off_tokens and "step_phases" not in off_loads
    phases = loads["step_phases"]
    assert phases["enabled"] and phases["mixed"]["steps"] >= 1 and phases["decode"]["steps"] >= 4
    names = set(phases["decode"]["phases"])
    assert {"schedule", "batch_build", "embed", "norms", "attention", "moe", "lm_head", "sampling", "output"} <= names
