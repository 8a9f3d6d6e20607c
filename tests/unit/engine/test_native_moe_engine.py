"""The engine's greedy tokens with the native CPU MoE call (dsv4_kernels.cpu_moe) on and off:
identical on both V3 presets and v4-tiny, and the native call really ran on the decode steps."""

import pytest
import torch

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence
from dsv4_kernels import cpu_moe

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not cpu_moe.available(), reason="no native MoE here (no C compiler, or no AVX)"),
]


def _greedy(model_dir, prompts, n):
    engine = Engine(EngineArgs(model=str(model_dir), device="cpu", kernel_backend="cpu", dtype="float32", kv_pages=64))
    seqs = [
        Sequence(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    for s in seqs:
        engine.submit(s)
    while engine.scheduler.has_work() or any(len(s.output_ids) < n for s in seqs):
        engine.step()
    return [s.output_ids for s in seqs]


@pytest.mark.parametrize("preset", ["tiny", "mla512", "v4-tiny"])
def test_greedy_tokens_native_on_and_off(preset, make_model, monkeypatch):
    model_dir = make_model(preset)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 200, (n,), generator=g).tolist() for n in (9, 23, 80)]
    calls = []
    real = cpu_moe.experts
    monkeypatch.setattr(cpu_moe, "experts", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    on = _greedy(model_dir, prompts, 12)
    assert calls and max(calls) <= cpu_moe.MAX_TOKENS  # decode steps went native; the 112-token prefill did not
    monkeypatch.setattr(cpu_moe, "MAX_TOKENS", 0)
    calls.clear()
    off = _greedy(model_dir, prompts, 12)
    assert not calls
    assert on == off
