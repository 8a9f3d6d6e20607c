"""The native CPU RMSNorm (dsv4_kernels.cpu_rmsnorm) against the torch form (reference.rmsnorm)
and fp64: same contract, fp32 rounding differences only."""

import pytest
import torch

from dsv4_kernels import cpu_rmsnorm
from dsv4_kernels import reference as R

pytestmark = pytest.mark.skipif(not cpu_rmsnorm.available(), reason="no native build here")


def _fp64(x, w, eps, res):
    h = x.double() if res is None else x.double() + res.double()
    return w.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps), h


@pytest.mark.parametrize("T", [0, 1, 3, 32])
@pytest.mark.parametrize("D", [1, 15, 16, 128, 512, 1031])
@pytest.mark.parametrize("with_res", [False, True])
def test_matches_torch_form_and_fp64(T, D, with_res):
    g = torch.Generator().manual_seed(T * 1000 + D)
    x = torch.randn(T, D, generator=g) * 3
    w = torch.randn(D, generator=g)
    res = torch.randn(T, D, generator=g) if with_res else None
    eps = 1e-6
    out, res_out = cpu_rmsnorm.rmsnorm(x, w, eps, res)
    ref_out, ref_res = R.rmsnorm(x, w, eps, res)
    f64, h64 = _fp64(x, w, eps, res)
    assert torch.equal(res_out, ref_res)  # the residual add is one rounding either way
    if with_res and T:
        assert res_out.data_ptr() not in (x.data_ptr(), res.data_ptr())  # inputs left alone
    elif not with_res:
        assert res_out is x
    # |w| * |h| * r scale: a few ulps of the normalised value, either side
    bound = 8 * 2**-23 * (w.abs().double() * h64.abs() * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps)) + 1e-30
    assert ((out.double() - f64).abs() <= bound).all()
    assert ((out - ref_out).abs().double() <= 2 * bound).all()


def test_strided_rows_as_a_projection_slice():
    g = torch.Generator().manual_seed(7)
    ckv = torch.randn(5, 512 + 64, generator=g)
    x = ckv[:, :512]  # the kv_a latent: rows 576 apart
    w = torch.randn(512, generator=g)
    assert cpu_rmsnorm.supports(x, w)
    out, _ = cpu_rmsnorm.rmsnorm(x, w, 1e-6)
    ref, _ = R.rmsnorm(x.contiguous(), w, 1e-6)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_supports_only_what_it_takes():
    x, w = torch.randn(2, 8), torch.randn(8)
    assert cpu_rmsnorm.supports(x, w) and cpu_rmsnorm.supports(x, w, torch.randn(2, 8))
    assert not cpu_rmsnorm.supports(x.double(), w.double())
    assert not cpu_rmsnorm.supports(x.bfloat16(), w)
    assert not cpu_rmsnorm.supports(x.t(), torch.randn(2))  # channels not contiguous
    assert not cpu_rmsnorm.supports(x, w, torch.randn(8, 2).t())
    assert not cpu_rmsnorm.supports(torch.randn(2, 3, 8), w)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("preset", ["tiny", "mla512"])
def test_engine_greedy_tokens_native_norm_on_and_off(preset, make_model, monkeypatch):
    from dsv4_engine.engine import Engine
    from dsv4_engine.engine_args import EngineArgs
    from dsv4_engine.sampling_params import SamplingParams
    from dsv4_engine.sequence import Sequence

    model_dir = make_model(preset)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 200, (n,), generator=g).tolist() for n in (9, 23, 80)]

    def greedy():
        engine = Engine(
            EngineArgs(model=str(model_dir), device="cpu", kernel_backend="cpu", dtype="float32", kv_pages=64)
        )
        seqs = [
            Sequence(f"r{i}", p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
            for i, p in enumerate(prompts)
        ]
        for s in seqs:
            engine.submit(s)
        while engine.scheduler.has_work() or any(len(s.output_ids) < 12 for s in seqs):
            engine.step()
        return [s.output_ids for s in seqs]

    calls = []
    real = cpu_rmsnorm.rmsnorm
    monkeypatch.setattr(cpu_rmsnorm, "rmsnorm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    on = greedy()
    assert calls  # the model's norms went native
    monkeypatch.setattr(cpu_rmsnorm, "supports", lambda *a: False)
    calls.clear()
    off = greedy()
    assert not calls
    assert on == off
