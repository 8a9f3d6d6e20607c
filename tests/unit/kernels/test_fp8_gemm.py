"""Block-scaled FP8 GEMMs (w8a8): the Triton kernels against the torch references, and the
references against the dequantized weights. Shapes are deliberately not multiples of 128 (edge
blocks of weights and activation groups are partial), and experts get ragged token counts,
one of them none."""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels import reference_quant as ref

# The kernels and the references quantize activations identically (bit for bit, checked below),
# so under the interpreter what differs is fp32 accumulation order only. On GPUs the fp8 tensor
# cores add each 128-long chunk of products at reduced precision (Hopper keeps ~14 bits; the
# kernel promotes every chunk to fp32, as DeepSeek's inference does).
KERNEL_TOL = dict(atol=1e-5, rtol=1e-5) if not torch.cuda.is_available() else dict(atol=1e-3, rtol=1e-3)


def quantized(n: int, k: int, seed: int, std: float = 0.08):
    """Random weights as the engine holds them: e4m3 and one fp32 scale per row and 128-group,
    constant over 128-row blocks (what a 128x128 checkpoint block scale expands to)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * std
    nb, kb = -(-n // 128), -(-k // 128)
    pad = torch.zeros(nb * 128, kb * 128)
    pad[:n, :k] = w
    amax = pad.view(nb, 128, kb, 128).abs().amax(dim=(1, 3))
    s = amax / ref.FP8_MAX
    q = (pad.view(nb, 128, kb, 128) / s[:, None, :, None]).to(torch.float8_e4m3fn).view(nb * 128, kb * 128)[:n, :k]
    return q.contiguous(), s.repeat_interleave(128, 0)[:n].contiguous(), w


def test_act_quant_matches_reference_bit_for_bit(device):
    from dsv4_kernels.triton_kernels.fp8_gemm import fp8_act_quant

    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 300, generator=g) * 3
    x[2, 128:256] = 0  # an all-zero group gets scale 1, not a division by zero
    x[3, 5] = 4000.0  # one outlier sets its group's scale
    q, s = fp8_act_quant(x.to(device))
    rq, rs = ref.fp8_act_quant(x)
    # equal as values (the interpreter writes -0.0 as +0.0; the GEMM cannot tell them apart)
    assert torch.equal(q.cpu().float(), rq.float())
    assert torch.equal(s.cpu(), rs)
    assert s[2, 1] == 1.0


def test_reference_linear_is_the_dequantized_product_within_fp8_error():
    q, s, w = quantized(72, 200, seed=1)
    x = torch.randn(5, 200, generator=torch.Generator().manual_seed(2))
    y = ref.fp8_linear(x, q, s)
    exact = x @ ref.dequantize_fp8_rows(q, s).T
    # e4m3 keeps 3 mantissa bits: each activation is off by <= 2**-4 relative
    assert (y - exact).abs().max() <= 2**-4 * (x.abs() @ ref.dequantize_fp8_rows(q, s).abs().T).max()
    assert (ref.dequantize_fp8_rows(q, s) - w).abs().max() <= 2**-4 * w.abs().max()


@pytest.mark.parametrize("scales", ["block", "row"])
@pytest.mark.parametrize("m,n,k", [(1, 72, 200), (5, 130, 256), (19, 64, 96)])
def test_linear_matches_reference(device, m, n, k, scales):
    from dsv4_kernels.triton_kernels.fp8_gemm import fp8_linear

    q, s, _ = quantized(n, k, seed=m)
    if scales == "block":  # the checkpoint's layout: one scale row per 128 weight rows
        s = s[::128].contiguous()
        assert ref.scale_row_block(q, s) == 128 or n == 1
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3))
    y = fp8_linear(x.to(device), q.to(device), s.to(device))
    torch.testing.assert_close(y.cpu(), ref.fp8_linear(x, q, s), **KERNEL_TOL)


@pytest.mark.parametrize("limit,inter,scales", [(None, 72, "row"), (0.4, 72, "row"), (0.4, 128, "block")])
def test_moe_experts_match_reference_with_ragged_experts(device, limit, inter, scales):
    from dsv4_kernels.triton_kernels.fp8_gemm import fp8_moe_experts

    E, H, T = 4, 200, 6
    w13 = [quantized(2 * inter, H, seed=10 + e) for e in range(E)]
    w2 = [quantized(H, inter, seed=20 + e) for e in range(E)]
    W13, S13 = torch.stack([a for a, _, _ in w13]), torch.stack([b for _, b, _ in w13])
    W2, S2 = torch.stack([a for a, _, _ in w2]), torch.stack([b for _, b, _ in w2])
    if scales == "block":  # gate|up rows meet at a 128-row boundary: block scales as stored
        S13, S2 = S13[:, ::128].contiguous(), S2[:, ::128].contiguous()
    # expert 1 gets 5 rows, expert 0 four, expert 2 three, expert 3 none
    ids = torch.tensor([[0, 1], [1, 2], [0, 2], [1, 0], [1, 2], [0, 1]])
    weights = torch.rand(T, 2, generator=torch.Generator().manual_seed(4))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(5))
    dev = lambda t: t.to(device)  # noqa: E731
    y = fp8_moe_experts(dev(x), dev(W13), dev(S13), dev(W2), dev(S2), dev(weights), dev(ids), limit)
    expected = ref.fp8_moe_experts(x, W13, S13, W2, S2, weights, ids, limit)
    torch.testing.assert_close(y.cpu(), expected, **KERNEL_TOL)
    if limit:  # the clamp bites at this size: the unclamped answer is different
        assert not torch.allclose(expected, ref.fp8_moe_experts(x, W13, S13, W2, S2, weights, ids, None), atol=1e-3)


def test_moe_experts_skip_other_ranks_pairs(device):
    """Tensor parallelism: pairs of another rank's experts (id -1) add nothing; the rest is the
    answer with those pairs' weights at 0 (and a huge expert 0 nobody routes to stays unread)."""
    from dsv4_kernels.triton_kernels.fp8_gemm import fp8_moe_experts

    E, H, T, inter = 2, 200, 6, 72
    w13 = [quantized(2 * inter, H, seed=30 + e) for e in range(E)]
    w2 = [quantized(H, inter, seed=40 + e) for e in range(E)]
    W13, S13 = torch.stack([a for a, _, _ in w13]), torch.stack([b for _, b, _ in w13])
    W2, S2 = torch.stack([a for a, _, _ in w2]), torch.stack([b for _, b, _ in w2])
    ids = torch.tensor([[-1, 1], [1, -1], [-1, -1], [1, -1], [1, 1], [-1, 1]])
    weights = torch.rand(T, 2, generator=torch.Generator().manual_seed(6))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(7))
    S13[0] = float("inf")  # expert 0 is chosen by nobody: computing anything on it gives inf / NaN
    dev = lambda t: t.to(device)  # noqa: E731
    y = fp8_moe_experts(dev(x), dev(W13), dev(S13), dev(W2), dev(S2), dev(weights), dev(ids), None)
    expected = ref.fp8_moe_experts(x, W13, S13, W2, S2, weights * (ids >= 0), ids.clamp(min=1), None)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.cpu(), expected, **KERNEL_TOL)
    torch.testing.assert_close(ref.fp8_moe_experts(x, W13, S13, W2, S2, weights, ids, None), expected, **KERNEL_TOL)
