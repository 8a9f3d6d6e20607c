"""Speculative decoding (MTP) over an FP8 KV cache (`--kv-cache-dtype fp8_e4m3`), V3 and V4: the
draft block's KV is packed as the model's, the verify step reads and writes the packed states,
rejected drafts roll the packed rings back, and greedy output equals plain decoding over the
same FP8 cache token for token (every key is read as stored, whichever step wrote it)."""

from __future__ import annotations

import random

import pytest
import torch

from dsv4_engine.sampling_params import SamplingParams
from spec_testutil import run_all, spec_engine, steer

FP8 = dict(kv_cache_dtype="fp8_e4m3")


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    from dsv4_engine.checkpoint import init_checkpoint

    def make(preset: str):
        return init_checkpoint(tmp_path_factory.mktemp("fp8mtp") / preset, preset=preset, seed=0, mtp=True)

    return make


def requests(lens: list[int], seed: int = 0) -> list:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(2, 500) for _ in range(n)],
            SamplingParams(max_tokens=rng.randint(8, 14), temperature=0, ignore_eos=True),
        )
        for n in lens
    ]


@pytest.mark.parametrize("preset", [pytest.param("tiny", marks=pytest.mark.slow), "v4-tiny"])
def test_mtp_over_fp8_kv_equals_plain_decoding_over_fp8_kv(mtp_model, preset):
    """Drafts steered half right: verify, rollback and catch-up all run over the packed states."""
    model = mtp_model(preset)
    reqs = requests([7, 17])
    plain = run_all(spec_engine(model, False, **FP8), reqs)
    engine = spec_engine(model, True, steps=3, **FP8)
    assert engine.kv_cache_dtype == "fp8_e4m3"
    assert {s.name: s.kv_dtype for s in engine.spec.state_specs} == {engine.spec.state_specs[0].name: "fp8_e4m3"}
    steer(engine, plain, {"r0": 1.0, "r1": 0.5})
    assert run_all(engine, reqs) == plain
    t = engine.metrics.totals
    assert 0 < t["spec_decode_num_accepted_tokens"] < t["spec_decode_num_draft_tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "v4-tiny"])
def test_mtp_over_fp8_kv_with_the_real_drafter_across_boundaries_and_preemption(mtp_model, preset):
    """Prompts ending around V4's window and compression boundaries, a pool small enough to
    preempt, the real drafter then drafts steered right, wrong and in between."""
    model = mtp_model(preset)
    reqs = requests([3, 7, 8, 9, 15, 16, 17, 23], seed=1)
    plain = run_all(spec_engine(model, False, kv_pages=12, **FP8), reqs)
    assert run_all(spec_engine(model, True, steps=3, kv_pages=12, **FP8), reqs) == plain
    engine = spec_engine(model, True, steps=3, kv_pages=12, **FP8)
    steer(engine, plain, {f"r{i}": a for i, a in enumerate([1.0, 0.0, 0.5, 0.8, 0.3, 0.6, 1.0, 0.2])})
    assert run_all(engine, reqs) == plain
