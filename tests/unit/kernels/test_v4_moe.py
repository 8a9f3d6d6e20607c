"""V4 MoE routing (sqrt-softplus + bias top-k, hash routing) and the routed experts with V4's
clamped SwiGLU, Triton against the torch reference, at small and V4-Flash sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsv4_kernels import reference_v4 as ref
from dsv4_kernels.triton_kernels import v4_moe_route as route_k
from dsv4_kernels.triton_ops import moe_experts


@pytest.mark.parametrize(
    "experts,top_k,scoring", [(4, 2, "sqrtsoftplus"), (256, 6, "sqrtsoftplus"), (64, 6, "sigmoid")]
)
def test_learned_routing_matches_reference(device, experts, top_k, scoring):
    gen = torch.Generator().manual_seed(experts)
    logits = (torch.randn(37, experts, generator=gen) * 3).to(device)
    logits[0, :3] = torch.tensor([30.0, -30.0, 0.0])  # softplus' far ends
    bias = (torch.randn(experts, generator=gen) * 0.05).to(device)
    ids_in = torch.randint(0, 100, (37,), generator=gen).to(device)
    w_ref, i_ref = ref.v4_moe_route(logits, bias, None, ids_in, top_k, 1.5, scoring)
    w, i = route_k.v4_moe_route(logits, bias, None, ids_in, top_k, 1.5, scoring)
    assert torch.equal(i.cpu(), i_ref.cpu())
    # elementwise float32 (score, a top-k sum of <= 8 terms, one divide, one scale): ~10 ulps
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w.sum(-1), torch.full_like(w[:, 0], 1.5))


def test_hash_routing_matches_reference(device):
    gen = torch.Generator().manual_seed(1)
    experts, top_k, vocab = 256, 6, 300
    logits = torch.randn(50, experts, generator=gen).to(device)
    tid2eid = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(vocab)]).to(device)
    ids_in = torch.randint(0, vocab, (50,), generator=gen).to(device)
    w_ref, i_ref = ref.v4_moe_route(logits, None, tid2eid, ids_in, top_k, 1.5, "sqrtsoftplus")
    w, i = route_k.v4_moe_route(logits, None, tid2eid, ids_in, top_k, 1.5, "sqrtsoftplus")
    assert torch.equal(i.cpu(), tid2eid[ids_in].to(torch.int32).cpu())
    assert torch.equal(i.cpu(), i_ref.cpu())
    # elementwise float32 as above: ~10 ulps
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)


def model_swiglu_experts(x, w13, w2, wts, ids, limit):
    """The V4 model's MoE loop (deepseek_v4._moe), as an independent check of the reference."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        tok, k = torch.where(ids == e)
        gate, up = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
        h = F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
        out.index_add_(0, tok, F.linear(h, w2[e]) * wts[tok, k, None])
    return out


@pytest.mark.parametrize("tokens", [3, 300])
def test_clamped_swiglu_experts_span_several_m_blocks(device, tol, tokens):
    """300 tokens x top-2 over 4 experts: ~150 rows an expert, several M-blocks each; a limit
    small enough that the clamp bites."""
    gen = torch.Generator().manual_seed(tokens)
    E, hidden, inter, top_k, limit = 4, 64, 32, 2, 0.5
    x = torch.randn(tokens, hidden, generator=gen).to(device)
    w13 = (torch.randn(E, 2 * inter, hidden, generator=gen) * 0.3).to(device)
    w2 = (torch.randn(E, hidden, inter, generator=gen) * 0.3).to(device)
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32).to(device)
    wts = torch.rand(tokens, top_k, generator=gen).to(device)
    want = ref.v4_moe_experts(x, w13, w2, wts, ids, limit)
    torch.testing.assert_close(want, model_swiglu_experts(x, w13, w2, wts, ids.long(), limit), atol=1e-5, rtol=1e-5)
    gate = x @ w13[:, :inter].reshape(-1, hidden).t()
    assert (gate > limit).any(), "the clamp must bite in this test"
    got = moe_experts(x, w13, w2, wts, ids, swiglu_limit=limit)
    torch.testing.assert_close(got, want, **tol[torch.float32])
    if tokens > 100:
        from dsv4_kernels.triton_kernels.moe_experts import experts_config

        assert tokens * top_k / E > 2 * experts_config(tokens * top_k, E, 4).block_m
