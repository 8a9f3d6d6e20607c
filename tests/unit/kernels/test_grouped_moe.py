"""The grouped routed experts (dsv4_kernels.grouped_moe) against the per-expert index_add loop
they replaced: bit for bit at top-2 (each pair's rows go through the same matmul shapes, and
two terms sum the same in any order), within rounding at top-k > 2, and other ranks' pairs
(-1) add nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsv4_kernels.grouped_moe import grouped_experts


def loop_experts(x, w13, w2, wts, ids, act, dtype):
    out = torch.zeros(x.shape[0], x.shape[1], dtype=dtype)
    for e in torch.unique(ids).tolist():
        if not 0 <= e < w13.shape[0]:
            continue
        tok, k = torch.where(ids == e)
        ys = act(x[tok].to(dtype) @ w13[e].to(dtype).t()) @ w2[e].to(dtype).t()
        out.index_add_(0, tok, ys * wts[tok, k, None].to(dtype))
    return out


def silu_mul(g):
    i = g.shape[1] // 2
    return F.silu(g[:, :i]) * g[:, i:]


def inputs(tokens, experts, top_k, hidden=64, inter=48, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.1).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
    wts = torch.rand(tokens, top_k, generator=gen).to(dtype)
    return x, w13, w2, wts, ids


@pytest.mark.parametrize("tokens,experts", [(1, 8), (8, 8), (32, 8), (33, 4), (5, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top2_is_bit_for_bit_the_per_expert_loop(tokens, experts, dtype):
    x, w13, w2, wts, ids = inputs(tokens, experts, 2, dtype=dtype)
    got = grouped_experts(x, w13, w2, wts, ids, silu_mul, dtype)
    assert torch.equal(got, loop_experts(x, w13, w2, wts, ids, silu_mul, dtype))


def test_top_k_above_two_matches_within_rounding_and_other_ranks_pairs_add_nothing():
    x, w13, w2, wts, ids = inputs(16, 8, 4)
    ids[::3, 1] = -1  # another rank's expert
    got = grouped_experts(x, w13, w2, wts, ids, silu_mul)
    torch.testing.assert_close(got, loop_experts(x, w13, w2, wts, ids, silu_mul, torch.float32), rtol=1e-6, atol=1e-6)
    none = grouped_experts(x, w13, w2, wts, torch.full_like(ids, -1), silu_mul)
    assert torch.equal(none, torch.zeros_like(none))
