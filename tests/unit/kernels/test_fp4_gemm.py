"""FP4 (e2m1, power-of-two scale per 32 values) weight GEMMs: the Triton kernels against the torch
references, and the unpacking against hand-decoded bytes and transformers' own table. K is a
multiple of 32 but not of the 64-wide K tile; N is not a multiple of the N tile; experts get
ragged token counts."""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels import reference_quant as ref

KERNEL_TOL = dict(atol=1e-5, rtol=1e-5) if not torch.cuda.is_available() else dict(atol=1e-4, rtol=1e-4)


def packed(n: int, k: int, seed: int):
    """Random packed e2m1 codes [n, k/2] and e8m0 exponents [n, k/32] around 2**-3."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.int64).to(torch.uint8)
    exps = torch.randint(121, 126, (n, k // 32), generator=g, dtype=torch.int64).to(torch.uint8)
    return codes, exps


def test_unpack_decodes_low_nibble_first():
    # byte 0x71: low nibble 1 (0.5) is element 0, high nibble 7 (6.0) element 1; 0xF8: -0.0 then -6.0
    v = ref.unpack_fp4(torch.tensor([[0x71, 0xF8]], dtype=torch.uint8))
    assert v.tolist() == [[0.5, 6.0, -0.0, -6.0]]
    s = torch.tensor([[128]], dtype=torch.uint8)  # 2**1
    w = ref.dequantize_fp4(torch.full((1, 16), 0x22, dtype=torch.uint8), s)
    assert torch.equal(w, torch.full((1, 32), 2.0))


def test_unpack_agrees_with_transformers():
    fp8_mod = pytest.importorskip("transformers.integrations.finegrained_fp8")
    codes, _ = packed(3, 64, seed=0)
    theirs = fp8_mod.Fp8Dequantize(None)._unpack_fp4(codes.view(torch.int8))
    assert torch.equal(ref.unpack_fp4(codes), theirs)


@pytest.mark.parametrize("m,n,k", [(1, 72, 160), (6, 130, 64), (17, 40, 96)])
def test_linear_matches_reference(device, m, n, k):
    from dsv4_kernels.triton_kernels.fp4_gemm import fp4_linear

    w, s = packed(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    y = fp4_linear(x.to(device), w.to(device), s.to(device))
    torch.testing.assert_close(y.cpu(), ref.fp4_linear(x, w, s), **KERNEL_TOL)
    torch.testing.assert_close(ref.fp4_linear(x, w, s), x @ ref.dequantize_fp4(w, s).T)


@pytest.mark.parametrize("limit", [None, 1.0])
def test_moe_experts_match_reference_with_ragged_experts(device, limit):
    from dsv4_kernels.triton_kernels.fp4_gemm import fp4_moe_experts

    E, H, inter, T = 4, 160, 96, 6
    w13 = [packed(2 * inter, H, seed=10 + e) for e in range(E)]
    w2 = [packed(H, inter, seed=20 + e) for e in range(E)]
    W13, S13 = torch.stack([a for a, _ in w13]), torch.stack([b for _, b in w13])
    W2, S2 = torch.stack([a for a, _ in w2]), torch.stack([b for _, b in w2])
    ids = torch.tensor([[2, 1], [1, 2], [3, 2], [1, 3], [1, 2], [3, 1]])  # expert 0 gets none
    weights = torch.rand(T, 2, generator=torch.Generator().manual_seed(4))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(5))
    dev = lambda t: t.to(device)  # noqa: E731
    y = fp4_moe_experts(dev(x), dev(W13), dev(S13), dev(W2), dev(S2), dev(weights), dev(ids), limit)
    torch.testing.assert_close(y.cpu(), ref.fp4_moe_experts(x, W13, S13, W2, S2, weights, ids, limit), **KERNEL_TOL)
