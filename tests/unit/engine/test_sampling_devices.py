"""Every request's random generator lives on the device of the logits it samples from.

torch.multinomial raises when given a generator of another device, so a CPU generator with
CUDA logits failed every seeded or non-greedy request on a GPU. The engine below runs on CPU
but is told its runner's device is CUDA, and records the device of each generator it makes:
an engine that created CPU generators (the old `torch.Generator()`) fails this test.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_engine import sampling
from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.sampling import same_device
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence


_RealGenerator = torch.Generator


class RecordingGenerator:
    """Stands in for torch.Generator: records the device asked for, generates on the CPU."""

    made: list[torch.device] = []

    def __init__(self, device="cpu"):
        RecordingGenerator.made.append(torch.device(device))
        self._g = _RealGenerator()

    def manual_seed(self, seed):
        self._g.manual_seed(seed)
        return self


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=2, temperature=0.7),
        SamplingParams(max_tokens=2, temperature=0, seed=7),
        SamplingParams(max_tokens=2, temperature=1.0, top_p=0.9, seed=3),
    ],
)
def test_generators_are_made_on_the_runner_device(tiny_model, monkeypatch, params):
    engine = Engine(EngineArgs(model=str(tiny_model), device="cpu", kernel_backend="cpu", kv_pages=16))
    engine.runner.device = torch.device("cuda", 0)  # what the logits' device would be on a GPU
    RecordingGenerator.made = []
    monkeypatch.setattr(torch, "Generator", RecordingGenerator)
    seq = Sequence("r", [5, 6, 7], params)
    engine._add(seq)
    assert RecordingGenerator.made, "a seeded or non-greedy request got no generator"
    assert all(d == engine.runner.device for d in RecordingGenerator.made), RecordingGenerator.made


def test_sampler_fails_only_the_row_whose_generator_is_elsewhere():
    logits = torch.randn(3, 11)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0)]

    class Elsewhere:  # a generator on a device the CPU logits are not on
        device = torch.device("cuda", 0)

    gens = [torch.Generator().manual_seed(1), Elsewhere(), None]
    out = sampling.sample(logits, params, gens)
    assert isinstance(out[0], sampling.Sampled) and isinstance(out[2], sampling.Sampled)
    assert isinstance(out[1], sampling.SamplingError) and "cuda" in str(out[1])


def test_every_generator_matches_the_logits_device_in_a_real_step(tiny_model):
    """The devices the sampler sees in a real engine step are equal (CPU here, CUDA on a GPU)."""
    engine = Engine(EngineArgs(model=str(tiny_model), device="cpu", kernel_backend="cpu", kv_pages=16))
    seqs = [Sequence(f"r{i}", [5 + i, 6, 7], SamplingParams(max_tokens=1, temperature=0.8, seed=i)) for i in range(3)]
    for s in seqs:
        engine._add(s)
    batch = engine.scheduler.schedule()
    logits = engine.runner.forward(batch, engine.pool)
    for b in batch:
        assert same_device(b.seq.generator.device, logits.device)


def test_same_device_normalises_cuda_indices():
    assert same_device(torch.device("cpu"), torch.device("cpu"))
    assert not same_device(torch.device("cpu"), torch.device("cuda", 0))
    assert not same_device(torch.device("cuda", 0), torch.device("cuda", 1))
