"""The native expert choice (dsv4_kernels.cpu_moe_route) against reference.moe_route: the same
weights and ids bit for bit, ties and NaNs handed to the torch form."""

import pytest
import torch

from dsv4_kernels import cpu_moe_route
from dsv4_kernels import reference as ref

pytestmark = pytest.mark.skipif(not cpu_moe_route.available(), reason="no native build here")

SHAPES = [  # E, n_group, topk_group, k, norm
    (8, 2, 1, 2, True),  # mla512
    (8, 1, 1, 2, False),
    (256, 8, 4, 8, True),  # DeepSeek-V3
    (64, 8, 3, 6, True),
    (16, 4, 4, 16, True),  # every expert chosen
]


def _both(logits, bias, E, G, TG, k, norm, monkeypatch):
    fell_back = []
    real = ref.moe_route
    monkeypatch.setattr(ref, "moe_route", lambda *a: fell_back.append(1) or real(*a))
    got = cpu_moe_route.moe_route(logits, bias, G, TG, k, norm, 2.5)
    monkeypatch.setattr(ref, "moe_route", real)
    want = ref.moe_route(logits, bias, G, TG, k, norm, 2.5)
    return got, want, bool(fell_back)


@pytest.mark.parametrize("E,G,TG,k,norm", SHAPES)
@pytest.mark.parametrize("T", [0, 1, 7, 64])
def test_same_bits_as_the_torch_form(E, G, TG, k, norm, T, monkeypatch):
    g = torch.Generator().manual_seed(E * 100 + T)
    logits = torch.randn(T, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.1
    (w, i), (w_ref, i_ref), fell = _both(logits, bias, E, G, TG, k, norm, monkeypatch)
    assert not fell  # distinct random values: the native choice ran
    assert i.dtype == i_ref.dtype == torch.int32
    assert torch.equal(i, i_ref) and torch.equal(w, w_ref)


@pytest.mark.parametrize("E,G,TG,k,norm", SHAPES[:3])
def test_ties_and_nans_fall_back_to_the_torch_form(E, G, TG, k, norm, monkeypatch):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, E, generator=g)
    bias = torch.zeros(E)
    logits[1, 1] = logits[1, 0] = 9.0  # the two best equal
    (w, i), (w_ref, i_ref), fell = _both(logits, bias, E, G, TG, k, norm, monkeypatch)
    assert fell and torch.equal(i, i_ref) and torch.equal(w, w_ref)
    logits[1, 1] = float("nan")
    (w, i), (w_ref, i_ref), fell = _both(logits, bias, E, G, TG, k, norm, monkeypatch)
    assert fell and torch.equal(i, i_ref)
    torch.testing.assert_close(w, w_ref, rtol=0, atol=0, equal_nan=True)


def test_ties_that_cannot_matter_still_run_native(monkeypatch):
    logits = torch.tensor([[5.0, 4.0, -3.0, -3.0, 0.5, 0.2, 0.1, 0.0]])  # a tie below the top 2, last group
    (w, i), (w_ref, i_ref), fell = _both(logits, torch.zeros(8), 8, 2, 1, 2, True, monkeypatch)
    assert not fell and torch.equal(i, i_ref) and torch.equal(w, w_ref)


def test_supports_only_what_it_takes():
    assert cpu_moe_route.supports(torch.randn(2, 8), torch.randn(8))
    assert not cpu_moe_route.supports(torch.randn(2, 8).double(), torch.randn(8))
    assert not cpu_moe_route.supports(torch.randn(2, 8), torch.randn(8).double())
    assert not cpu_moe_route.supports(torch.randn(2, 8), torch.randn(7))


@pytest.mark.usefixtures("one_torch_thread")
def test_engine_routes_natively_with_the_same_greedy_tokens(make_model, monkeypatch):
    from dsv4_engine.engine import Engine
    from dsv4_engine.engine_args import EngineArgs
    from dsv4_engine.sampling_params import SamplingParams
    from dsv4_engine.sequence import Sequence

    model_dir = make_model("mla512")
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(2, 200, (n,), generator=g).tolist() for n in (9, 40)]

    def greedy():
        engine = Engine(
            EngineArgs(model=str(model_dir), device="cpu", kernel_backend="cpu", dtype="float32", kv_pages=64)
        )
        seqs = [
            Sequence(f"r{i}", p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
            for i, p in enumerate(prompts)
        ]
        for s in seqs:
            engine.submit(s)
        while engine.scheduler.has_work() or any(len(s.output_ids) < 10 for s in seqs):
            engine.step()
        return [s.output_ids for s in seqs]

    calls = []
    real = cpu_moe_route.moe_route
    monkeypatch.setattr(cpu_moe_route, "moe_route", lambda *a: calls.append(1) or real(*a))
    on = greedy()
    assert calls
    monkeypatch.setattr(cpu_moe_route, "supports", lambda *a: False)
    calls.clear()
    assert greedy() == on
    assert not calls
