"""The Triton kernels fed exactly what a CUDA engine holds after loading a quantized checkpoint
(block scales as stored, concatenated gate|up rows, stacked experts, packed fp4 with e8m0 bytes),
against the torch references the CPU form of the same weights uses. Interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from dsv4_engine.checkpoint import init_checkpoint
from dsv4_engine.model_runner import ModelRunner
from dsv4_engine.quant import QuantWeight, moe_experts_for

# compiled kernels on a CUDA machine, the interpreter on CPU tensors elsewhere (tests/conftest.py);
# fp8 tensor cores add 128-long chunks at reduced precision (see tests/unit/kernels/test_fp8_gemm.py)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(atol=1e-5, rtol=1e-5) if DEV == "cpu" else dict(atol=1e-3, rtol=1e-3)


def on(*ts):
    return [t.to(DEV) for t in ts]


def kept_model(tmp_path, preset, quant, monkeypatch):
    d = init_checkpoint(tmp_path / preset, preset=preset, seed=0, quant=quant)
    monkeypatch.setattr("dsv4_engine.quant.load.keep_quantized", lambda device: True)
    return ModelRunner(d, "float32", "cpu", "torch").model


def routing(T: int, E: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    return torch.rand(T, k, generator=g), ids


def test_fp8_kernels_on_a_loaded_v3_checkpoint(tmp_path, monkeypatch):
    from dsv4_kernels.triton_kernels.fp8_gemm import fp8_linear, fp8_moe_experts

    model = kept_model(tmp_path, "tiny", "fp8", monkeypatch)
    moe = model.layers[1].mlp
    w13, w2 = moe.w13, moe.w2
    assert w13.row_block == 128  # gate|up of 128 rows each: block scales kept compact
    x = torch.randn(3, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    for w in (model.layers[1].attn.q_a.weight, model.layers[1].attn.kv_a.weight, moe.shared[0]):
        torch.testing.assert_close(fp8_linear(*on(x, w.data, w.scale)).cpu(), torch.nn.functional.linear(x, w), **TOL)
    wts, ids = routing(3, model.cfg.n_routed_experts, model.cfg.num_experts_per_tok, 1)
    expected = moe_experts_for(model.ops)(x, w13, w2, wts, ids)  # CPU: the reference
    got = fp8_moe_experts(*on(x, w13.data, w13.scale, w2.data, w2.scale, wts, ids)).cpu()
    torch.testing.assert_close(got, expected, **TOL)


def test_fp4_kernels_on_a_loaded_v4_checkpoint(tmp_path, monkeypatch):
    from dsv4_kernels import reference_quant as ref
    from dsv4_kernels.triton_kernels.fp4_gemm import fp4_linear, fp4_moe_experts

    model = kept_model(tmp_path, "v4-tiny", "fp4-experts", monkeypatch)
    moe = model.layers[2].ffn
    w13, w2 = moe.w13, moe.w2
    assert (w13.kind, w2.kind) == ("fp4", "fp4")
    x = torch.randn(3, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(
        fp4_linear(*on(x, w13[1].data, w13[1].scale)).cpu(), torch.nn.functional.linear(x, w13[1]), **TOL
    )
    wts, ids = routing(3, model.cfg.n_routed_experts, model.cfg.num_experts_per_tok, 2)
    limit = model.cfg.swiglu_limit
    expected = ref.fp4_moe_experts(x, w13.data, w13.scale, w2.data, w2.scale, wts, ids, limit)
    got = fp4_moe_experts(*on(x, w13.data, w13.scale, w2.data, w2.scale, wts, ids), limit).cpu()
    torch.testing.assert_close(got, expected, **TOL)
    # and the reference is what V4's own per-expert loop computes with these weights
    out = torch.zeros_like(x)
    for t in range(3):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = moe._swiglu(torch.nn.functional.linear(x[t : t + 1], w13[e]))
            out[t] += (torch.nn.functional.linear(h, w2[e]) * wts[t, j])[0]
    torch.testing.assert_close(expected, out, atol=1e-5, rtol=1e-5)
    mislabelled = QuantWeight("fp8", w2.data, w2.scale, w2.k)
    with pytest.raises(TypeError, match="share one format"):
        moe_experts_for(model.ops)(x, w13, mislabelled, wts, ids)
