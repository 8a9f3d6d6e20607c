"""RMSNorm (with the fused residual add) and interleaved rotary embedding: the references
against transformers' DeepseekV3 code and per-element loops; the Triton kernels against the
references."""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels import reference


def randn(*shape, dtype=torch.float32, device="cpu", seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_rmsnorm_is_transformers_rmsnorm_bit_for_bit(dtype):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    norm = DeepseekV3RMSNorm(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(96, seed=1) + 1)
    x, residual = randn(7, 96, dtype=dtype, seed=2), randn(7, 96, dtype=dtype, seed=3)

    out, res_out = reference.rmsnorm(x, norm.weight, 1e-6)
    assert torch.equal(out, norm(x)) and res_out is x
    out, res_out = reference.rmsnorm(x, norm.weight, 1e-6, residual)
    assert torch.equal(res_out, residual + x)  # the decoder layer's `residual + hidden_states`
    assert torch.equal(out, norm(residual + x))


def test_reference_rmsnorm_matches_per_row_loop():
    x, w = randn(5, 33, seed=4), randn(33, seed=5)
    out, _ = reference.rmsnorm(x, w, 1e-5)
    for row in range(5):
        values = x[row].double().tolist()
        rms = (sum(v * v for v in values) / len(values) + 1e-5) ** 0.5
        want = torch.tensor([v / rms * float(wi) for v, wi in zip(values, w)], dtype=torch.float64)
        torch.testing.assert_close(out[row].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(70, 100), (2, 3, 64)], ids=["2d-odd-width-many-rows", "3d"])
def test_triton_rmsnorm_matches_reference(device, tol, dtype, shape):
    from dsv4_kernels import triton_ops

    x, residual = randn(*shape, dtype=dtype, device=device, seed=6), randn(*shape, dtype=dtype, device=device, seed=7)
    w = (randn(shape[-1], seed=8) + 1).to(dtype).to(device)
    for res in (None, residual):
        want, want_res = reference.rmsnorm(x, w, 1e-6, res)
        got, got_res = triton_ops.rmsnorm(x, w, 1e-6, res)
        assert got.dtype == dtype and got.shape == x.shape and got_res.shape == x.shape
        torch.testing.assert_close(got.float(), want.float(), **tol[dtype])
        torch.testing.assert_close(got_res.float(), want_res.float(), **tol[dtype])
    assert triton_ops.rmsnorm(x, w, 1e-6)[1] is x


def test_triton_rmsnorm_reads_a_column_slice(device, tol):
    """The engine normalises ckv[:, :kv_lora_rank], a view whose rows are wider than it."""
    from dsv4_kernels import triton_ops

    ckv = randn(5, 80, device=device, seed=9)
    w = randn(64, device=device, seed=10)
    got, _ = triton_ops.rmsnorm(ckv[:, :64], w, 1e-6)
    torch.testing.assert_close(got, reference.rmsnorm(ckv[:, :64].contiguous(), w, 1e-6)[0], **tol[torch.float32])


def rope_table(max_pos, half, seed=11):
    angles = torch.rand(max_pos, half, generator=torch.Generator().manual_seed(seed)) * 6.3
    return angles.cos(), angles.sin()


def test_reference_rope_matches_transformers_after_deinterleaving():
    """HF returns the rotated pairs de-interleaved (evens, then odds); q.k is unchanged by that."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    tokens, heads, rot = 6, 3, 16
    cos, sin = rope_table(40, rot // 2)
    positions = torch.tensor([0, 7, 7, 39, 2, 11])
    q = randn(tokens, heads, rot, seed=12)
    hf_cos = torch.cat([cos, cos], -1)[positions].unsqueeze(0)  # [1, T, R], HF's cat(freqs, freqs) form
    hf_sin = torch.cat([sin, sin], -1)[positions].unsqueeze(0)
    q_hf = q.transpose(0, 1).unsqueeze(0)  # [1, H, T, R]
    want, _ = apply_rotary_pos_emb_interleave(q_hf, q_hf, hf_cos, hf_sin)
    got = reference.rope_interleaved_(q.clone(), positions, cos, sin)
    deinterleaved = torch.cat([got[..., 0::2], got[..., 1::2]], -1).transpose(0, 1).unsqueeze(0)
    assert torch.equal(deinterleaved, want)


def test_reference_rope_rotates_each_pair_in_place():
    cos, sin = rope_table(10, 4)
    x = randn(3, 2, 8, seed=13)
    positions = torch.tensor([9, 0, 4])
    want = x.clone().double()
    for t in range(3):
        for h in range(2):
            for i in range(4):
                a, b = float(x[t, h, 2 * i]), float(x[t, h, 2 * i + 1])
                c, s = float(cos[positions[t], i]), float(sin[positions[t], i])
                want[t, h, 2 * i], want[t, h, 2 * i + 1] = a * c - b * s, a * s + b * c
    got = reference.rope_interleaved_(x, positions, cos, sin)
    assert got is x
    # float32 a*c - b*s against float64: two products and a sum, <= 3 ulps of order-one values
    torch.testing.assert_close(x.double(), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_rope_matches_reference_on_a_strided_view(device, tol, dtype):
    """As the engine calls it: the rope tail of q [T, H, nope + R], and the k rope [T, 1, R]."""
    from dsv4_kernels import triton_ops

    cos, sin = (t.to(device) for t in rope_table(64, 8))
    positions = torch.tensor([3, 0, 63, 17, 17], device=device)
    q = randn(5, 3, 24 + 16, dtype=dtype, device=device, seed=14)
    ckv = randn(5, 64 + 16, dtype=dtype, device=device, seed=15)
    for base, view in ((q, lambda t: t[:, :, 24:]), (ckv, lambda t: t[:, 64:].unsqueeze(1))):
        want_base, got_base = base.clone(), base.clone()
        reference.rope_interleaved_(view(want_base), positions, cos, sin)
        out = triton_ops.rope_interleaved_(view(got_base), positions, cos, sin)
        assert out.data_ptr() == view(got_base).data_ptr()
        torch.testing.assert_close(got_base.float(), want_base.float(), **tol[dtype])
        assert torch.equal(got_base[..., :16], base[..., :16])  # outside the view: untouched


def test_triton_rope_covers_many_tokens_and_heads(device, tol):
    """More tokens and heads than one program takes."""
    from dsv4_kernels import triton_ops

    cos, sin = (t.to(device) for t in rope_table(300, 32))
    positions = torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(16)).to(device)
    x = randn(150, 20, 64, device=device, seed=17)
    want = reference.rope_interleaved_(x.clone(), positions, cos, sin)
    torch.testing.assert_close(triton_ops.rope_interleaved_(x, positions, cos, sin), want, **tol[torch.float32])
