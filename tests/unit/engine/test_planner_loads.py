"""What /v1/loads tells the operator's planner (docs/operations.md, "The planner"): prompt tokens
queued, the running batch's context, and the forward steps by kind with their sizes and seconds
(dsv4_engine.step_tally), counted as the engine runs."""

from __future__ import annotations

import pytest

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_queued_prompt_tokens_running_context_and_step_totals(make_model):
    engine = Engine(
        EngineArgs(model=str(make_model("tiny")), device="cpu", kernel_backend="cpu", kv_pages=64, max_num_seqs=2)
    )
    prompts = [[5 + i] * (8 + 4 * i) for i in range(3)]  # 8, 12 and 16 tokens
    seqs = [
        Sequence(f"r{i}", p, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    for s in seqs:
        s.sink = lambda out: None
        engine._add(s)
    before = engine.loads()
    assert before["queued_prompt_tokens"] == 8 + 12 + 16 and before["running_context_tokens"] == 0
    assert before["max_num_seqs"] == 2 and before["max_num_batched_tokens"] == engine.args.max_num_batched_tokens
    assert all(t["steps"] == 0 for t in before["steps"].values())
    engine.step()  # two prompts admitted (max_num_seqs 2) and prefilled in one step
    mid = engine.loads()
    assert mid["queued_prompt_tokens"] == 16  # the third waits
    assert mid["running_context_tokens"] == sum(s.num_tokens for s in engine.scheduler.running)
    prefill = mid["steps"]["prefill"]
    assert prefill["steps"] == 1 and prefill["requests"] == 2 and prefill["tokens"] == 8 + 12
    assert prefill["token_context"] == 8 * 8 + 12 * 12 and prefill["seconds"] > 0
    while engine.scheduler.has_work():
        engine.step()
    end = engine.loads()["steps"]
    assert end["decode"]["steps"] >= 4 and end["decode"]["tokens"] == end["decode"]["requests"]
    assert end["decode"]["request_context"] > end["decode"]["requests"] * 8  # contexts past the prompts
    assert sum(s.num_tokens for s in seqs) == 8 + 12 + 16 + 3 * 5
