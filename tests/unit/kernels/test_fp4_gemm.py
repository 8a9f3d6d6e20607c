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


def moe_fp32_bound(x, w13, w2, weights, ids, limit=None) -> torch.Tensor:
    """Per element, how far a float32 evaluation of the routed experts may be from exact, whatever
    its summation order (the kernel and the reference each are within it, so their difference is
    within twice it). Worst-case forward error, computed in float64 from the dequantized weights:
    a K-term dot product is within K * u of exact relative to the sum of its terms' magnitudes
    (u = 2**-24); swiglu (gate capped, up clamped at `limit`: 1-Lipschitz) carries its inputs'
    errors with |d/dgate| <= 1.1 |up| and |d/dup| <= |silu(gate)| and rounds once more; the weighted sum
    over the top-k adds a rounding of each term."""
    u = 2.0**-24
    x = x.double()
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tok, k = torch.where(ids == e)
        W13, W2 = w13[e].double(), w2[e].double()  # [2I, H], [H, I]
        a = x[tok] @ W13.T
        A = x[tok].abs() @ W13.abs().T * W13.shape[1] * u  # error of each gate/up entry
        g, up = a.chunk(2, -1)
        dg, du = A.chunk(2, -1)
        if limit:  # a value clamped even at the far end of its error carries no error on
            dg = torch.where(g - dg > limit, 0.0, dg)
            du = torch.where(up.abs() - du > limit, 0.0, du)
            g, up = g.clamp(max=limit), up.clamp(-limit, limit)
        h = torch.nn.functional.silu(g) * up
        dh = 1.1 * up.abs() * dg + torch.nn.functional.silu(g).abs() * du + h.abs() * u
        y = (h.abs() @ W2.abs().T) * W2.shape[1] * u + (dh @ W2.abs().T) + (h @ W2.T).abs() * u
        out.index_add_(0, tok, y * weights[tok, k, None].double().abs())
    return out + out.abs() * u * ids.shape[1]


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
    want = ref.fp4_moe_experts(x, W13, S13, W2, S2, weights, ids, limit)
    if device.type == "cuda":  # the device's approximate exp/division: the GPU tolerance
        torch.testing.assert_close(y.cpu(), want, **KERNEL_TOL)
        return
    deq13 = torch.stack([ref.dequantize_fp4(W13[e], S13[e]) for e in range(E)])
    deq2 = torch.stack([ref.dequantize_fp4(W2[e], S2[e]) for e in range(E)])
    bound = 2 * moe_fp32_bound(x, deq13, deq2, weights, ids, limit)  # values reach ~500: no fixed atol fits
    err = (y.cpu().double() - want.double()).abs()
    assert (err <= bound).all(), (
        f"max error {float(err.max()):.3g}, over its bound by {float((err / bound).max()):.3g}x"
    )
    # and the bound still sees a real fault: a kernel that skipped one token's second expert
    dropped = weights.clone()
    dropped[int(weights[:, 1].argmin()), 1] = 0.0
    skipped = ref.fp4_moe_experts(x, W13, S13, W2, S2, dropped, ids, limit)
    assert not ((skipped.double() - want.double()).abs() <= bound).all()


def test_native_fp4_path_is_chosen_by_architecture_and_dtype():
    """tl.dot_scaled on sm_100's tile family with bf16 activations; the registers decode on
    sm_90, sm_120, off CUDA (the interpreter has no dot_scaled), in fp32, or when disabled."""
    from dsv4_kernels.triton_kernels.common import tile_target
    from dsv4_kernels.triton_kernels.fp4_gemm import fp4_native

    b200 = tile_target(10, 0, 232448)  # datacentre Blackwell: tcgen05
    assert fp4_native(b200, torch.bfloat16)
    assert fp4_native(tile_target(10, 3, 232448), torch.bfloat16)  # sm_103 takes sm_100's tiles
    assert not fp4_native(b200, torch.float32)  # exact fp32 products: not a dot_scaled format
    assert not fp4_native(b200, torch.bfloat16, disabled=True)  # DSV4_FP4_NATIVE=0
    for major, minor, shared in ((9, 0, 232448), (12, 0, 101376), (12, 1, 101376), (8, 9, 101376)):
        assert not fp4_native(tile_target(major, minor, shared), torch.bfloat16), (major, minor)
    assert not fp4_native(None, torch.bfloat16)  # CPU tensors: the interpreter


def test_native_fp4_variants_are_compiled_where_they_run_with_the_fallback_beside_them():
    from dsv4_kernels.triton_kernels import fp4_gemm

    for arch in (90, 100, 120):
        names = {v.name: v.constexprs["NATIVE"] for v in fp4_gemm.aot_variants(arch)}
        native = {n for n, on in names.items() if on}
        if arch == 100:
            assert native and all(",bf16" not in n and n.startswith("fp4_gemm[bf16,") for n in native)
            assert {n.replace(",native", "") for n in native} <= set(names)  # the fall-back too
        else:
            assert not native
