"""The native small-M linear (dsv4_kernels.cpu_moe.linear) against fp64 within the worst-case
rounding bound of fp32 dot products and against F.linear, and the engine's greedy tokens with it
on and off (it really ran on the decode steps' projections)."""

import pytest
import torch
import torch.nn.functional as F

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence
from dsv4_kernels import cpu_moe

pytestmark = pytest.mark.skipif(not cpu_moe.available(), reason="no native MoE loop here (no C compiler, or no AVX)")

U = 2.0**-24  # fp32 unit roundoff


@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 8, 13, 32])
@pytest.mark.parametrize(
    "N,K",
    [
        (576, 512),  # mla512's q_b / kv_a
        (37, 100),  # rows off the 4-row blocks, K off the 16-lane vectors (and off 2-vector steps)
        (9, 7),  # shorter than a vector
        (130, 1040),  # rows past the prefetch distance (32 KB)
    ],
)
@pytest.mark.parametrize("strided", [False, True])
def test_linear_within_fp32_bound(T, N, K, strided):
    g = torch.Generator().manual_seed(T * 1000 + N + K)
    x = (
        torch.randn(T, K + 5 if strided else K, generator=g)[:, 3 : 3 + K]
        if strided
        else torch.randn(T, K, generator=g)
    )
    w = torch.randn(N, K, generator=g) / K**0.5
    assert cpu_moe.applies_linear(x, w) and x.stride(0) == (K + 5 if strided else K)
    got = cpu_moe.linear(x, w)
    assert got.shape == (T, N) and got.is_contiguous()
    want = x.double() @ w.double().t()
    tol = (K + 2) * U * (x.double().abs() @ w.double().abs().t()) + 1e-30
    assert ((got.double() - want).abs() <= tol).all()
    assert ((got.double() - F.linear(x, w).double()).abs() <= 2 * tol).all()


def test_applies_linear_only_where_it_can_run(monkeypatch):
    w = torch.zeros(8, 16)
    x = torch.zeros(cpu_moe.MAX_LINEAR_TOKENS, 16)
    assert cpu_moe.applies_linear(x, w)
    assert not cpu_moe.applies_linear(torch.zeros(cpu_moe.MAX_LINEAR_TOKENS + 1, 16), w)  # prefill: the GEMM
    assert not cpu_moe.applies_linear(torch.zeros(0, 16), w)
    assert not cpu_moe.applies_linear(torch.zeros(2, 16).bfloat16(), w)
    assert not cpu_moe.applies_linear(x, w.bfloat16())
    assert not cpu_moe.applies_linear(torch.zeros(16, 2).t(), w)  # channels strided
    assert not cpu_moe.applies_linear(x, torch.zeros(16, 8).t())  # W not contiguous
    assert not cpu_moe.applies_linear(torch.zeros(2, 3, 16), w)
    assert not cpu_moe.applies_linear(torch.zeros(2, 15), w)
    # a gradient wanted: the C loop has no backward
    assert not cpu_moe.applies_linear(x, w.clone().requires_grad_())
    assert not cpu_moe.applies_linear(x.clone().requires_grad_(), w)
    with torch.no_grad():
        assert cpu_moe.applies_linear(x, w.clone().requires_grad_())
    monkeypatch.setenv("DSV4_NO_NATIVE_LINEAR", "1")
    assert not cpu_moe.applies_linear(x, w)
    monkeypatch.delenv("DSV4_NO_NATIVE_LINEAR")
    monkeypatch.setattr(cpu_moe, "MAX_LINEAR_TOKENS", 0)
    assert not cpu_moe.applies_linear(x[:1], w)


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


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("preset", ["tiny", "mla512"])
def test_greedy_tokens_native_linear_on_and_off(preset, make_model, monkeypatch):
    model_dir = make_model(preset)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 200, (n,), generator=g).tolist() for n in (9, 23, 80)]
    calls = []
    real = cpu_moe.linear
    monkeypatch.setattr(cpu_moe, "linear", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    on = _greedy(model_dir, prompts, 12)
    assert calls and max(calls) <= cpu_moe.MAX_LINEAR_TOKENS  # decode steps went native, the prefill did not
    monkeypatch.setattr(cpu_moe, "MAX_LINEAR_TOKENS", 0)
    calls.clear()
    off = _greedy(model_dir, prompts, 12)
    assert not calls
    assert on == off
