"""The native passes around a prefill-sized MoE's GEMMs (dsv4_kernels.cpu_grouped_moe) against
the torch forms they replace: the gather and the top-k combine bit for bit, the SwiGLU within
silu's own rounding, and grouped_experts / the V3 MLP with them against the torch forms whole."""

import pytest
import torch
import torch.nn.functional as F

from dsv4_kernels import cpu_grouped_moe as C
from dsv4_kernels.grouped_moe import grouped_experts

pytestmark = pytest.mark.skipif(not C.available(), reason="no native build here")


def _torch_silu_mul(gate_up):
    inter = gate_up.shape[1] // 2
    return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]


def _torch_grouped(x, w13, w2, topk_weights, topk_ids):
    """grouped_experts' torch form: weight every pair's row, gather back, sum over k."""
    T, hidden = x.shape
    k, E = topk_ids.shape[1], w13.shape[0]
    ys = torch.zeros(T * k, hidden)
    flat = topk_ids.reshape(-1).long()
    for p in range(T * k):
        e = int(flat[p])
        if 0 <= e < E:
            h = _torch_silu_mul(x[p // k : p // k + 1] @ w13[e].t())
            ys[p] = (h @ w2[e].t())[0]
    ys *= topk_weights.reshape(-1)[:, None]
    return ys.view(T, k, hidden).sum(dim=1)


def test_gather_rows_is_index_select():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(9, 40, generator=g)
    x = base[:, 3:35]  # strided rows
    rows = torch.tensor([4, 0, 4, 8, 1])
    assert torch.equal(C.gather_rows(x, rows), x.index_select(0, rows))
    out = C.scratch("t_gather", 5, 32)
    assert C.gather_rows(x, rows, out).data_ptr() == out.data_ptr()
    assert torch.equal(out, x.index_select(0, rows))


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("D", [1, 13, 16, 512, 1031])
def test_combine_is_torch_weight_sum_add_bit_for_bit(k, D):
    g = torch.Generator().manual_seed(k * 100 + D)
    T = 37
    ys = torch.randn(T * k, D, generator=g) * 5
    pos = torch.randperm(T * k, generator=g).view(T, k)
    pos[3, 0] = -1  # another rank's expert
    pos[5] = -1
    w = torch.rand(T, k, generator=g)
    add = torch.randn(T, D, generator=g)
    # the torch form: dead rows zero, every row weighted, gathered back, summed over k, then add
    full = torch.cat([ys, torch.zeros(1, D)])
    ref = (full[pos.where(pos >= 0, T * k)] * w[..., None]).sum(dim=1)
    assert torch.equal(C.combine(ys, pos, w), ref)
    assert torch.equal(C.combine(ys, pos, w, add), ref + add)


def test_swiglu_within_silu_rounding():
    g = torch.Generator().manual_seed(1)
    gate_up = torch.randn(300, 2 * 257, generator=g) * 6
    gate_up[0, :6] = torch.tensor([100.0, -100.0, 88.5, -88.5, 0.0, -0.0])
    base = torch.randn(300, 2 * 257 + 5, generator=g)[:, : 2 * 257]
    for gu in (gate_up, base):  # contiguous and strided rows
        h = C.swiglu(gu)
        ref = _torch_silu_mul(gu.double())
        # silu(g) to ~1.5 ulp either way, then one more rounding for the product
        bound = 4 * 2**-23 * ref.abs() + 1e-30
        assert ((h.double() - ref).abs() <= bound).all()
    lin = torch.linspace(-30, 30, 4096)
    gu = torch.stack([lin, torch.ones_like(lin)], dim=1)
    assert (C.swiglu(gu)[:, 0] - F.silu(lin)).abs().max() <= 4 * 2**-23 * 30


def test_scratch_reuses_and_bounds():
    a = C.scratch("t_s", 4, 8)
    b = C.scratch("t_s", 2, 8)
    assert a.data_ptr() == b.data_ptr() and b.shape == (2, 8)
    assert C.scratch("t_other", 4, 8).data_ptr() != a.data_ptr()
    big = C.scratch("t_big", C.MAX_SCRATCH // 4 + 1, 4)
    assert big.data_ptr() != C.scratch("t_big", C.MAX_SCRATCH // 4 + 1, 4).data_ptr()  # not kept


@pytest.mark.parametrize("k", [1, 2, 4, 6])
def test_grouped_experts_native_matches_torch_form(k):
    g = torch.Generator().manual_seed(k)
    T, D, E, inter = 70, 48, 8, 24
    x = torch.randn(T, D, generator=g)
    w13 = torch.randn(E, 2 * inter, D, generator=g) * 0.2
    w2 = torch.randn(E, D, inter, generator=g) * 0.2
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
    ids[2, 0] = -1
    ids[9] = -1
    w = torch.rand(T, k, generator=g)
    add = torch.randn(T, D, generator=g)
    ref = _torch_grouped(x, w13, w2, w, ids)
    out = grouped_experts(x, w13, w2, w, ids, _torch_silu_mul, passes=C)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(grouped_experts(x, w13, w2, w, ids, _torch_silu_mul, add=add, passes=C), out + add)
    # the pure torch form (no passes: the reference's) sums in the same order
    assert torch.equal(grouped_experts(x, w13, w2, w, ids, _torch_silu_mul), out)
    assert torch.equal(out[9], torch.zeros(D))


def test_mlp_is_the_linear_form():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(33, 64, generator=g)
    w13 = torch.randn(2 * 40, 64, generator=g) * 0.2
    w2 = torch.randn(64, 40, generator=g) * 0.2
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    ref = F.linear(F.silu(gate) * up, w2)
    out = C.mlp(x, w13, w2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    kept = C.mlp(x, w13, w2, out_scratch="t_mlp")
    assert torch.equal(kept, out) and kept.data_ptr() == C.scratch("t_mlp", 33, 64).data_ptr()


def test_supports_only_fp32_cpu():
    assert C.supports(torch.randn(2, 4))
    assert not C.supports(torch.randn(2, 4).double())
    assert not C.supports(torch.randn(2, 4), torch.randn(2, 4).bfloat16())


def test_weights_that_want_a_gradient_keep_the_torch_form():
    """The native passes' results have no grad_fn: a forward that trains (weights requiring a
    gradient, grad mode on) must keep the differentiable torch form (the V3 MLP's F.linear)."""
    x, w13, w2 = torch.randn(6, 16), torch.randn(24, 16).requires_grad_(), torch.randn(16, 12)
    assert not C.supports(x, w13, w2)
    with torch.no_grad():
        assert C.supports(x, w13, w2)
    assert C.supports(x, w13.detach(), w2)


def test_scratch_made_under_inference_mode_is_not_reused_outside_it():
    with torch.inference_mode():
        inside = C.scratch("mode_probe", 4, 8)
    outside = C.scratch("mode_probe", 4, 8)
    assert not outside.is_inference()
    outside.fill_(1.0)  # an inference tensor would refuse this in-place write
    with torch.inference_mode():
        assert C.scratch("mode_probe", 4, 8).data_ptr() == inside.data_ptr()
