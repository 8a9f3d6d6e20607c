"""MoE routing and experts: the torch references against transformers' DeepseekV3 modules and
against per-token formulations; the Triton kernels against the references."""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels import reference


def hf_modules():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    return DeepseekV3Config, hf


def sort_by_id(weights, ids):
    """Routing order is unspecified (HF uses topk(sorted=False)): compare as id-sorted pairs."""
    ids = ids.long().cpu()
    order = ids.argsort(dim=-1)
    return weights.float().cpu().gather(1, order), ids.gather(1, order)


def naive_route(logits, bias, n_group, topk_group, top_k, norm, scale):
    """One token at a time, with Python sorting."""
    num_experts = logits.shape[1]
    size = num_experts // n_group
    weights, ids = [], []
    for row in logits.double().cpu():
        score = torch.sigmoid(row)
        choice = (score + bias.double().cpu()).tolist()
        group_score = [sum(sorted(choice[g * size : (g + 1) * size], reverse=True)[:2]) for g in range(n_group)]
        kept = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        candidates = [e for g in kept for e in range(g * size, (g + 1) * size)]
        chosen = sorted(candidates, key=lambda e: -choice[e])[:top_k]
        w = [float(score[e]) for e in chosen]
        if norm:
            total = sum(w) + 1e-20
            w = [x / total for x in w]
        weights.append([x * scale for x in w])
        ids.append(chosen)
    return torch.tensor(weights), torch.tensor(ids)


# (tokens, experts, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor)
ROUTES = [
    (5, 8, 1, 1, 2, False, 1.0),
    (7, 16, 4, 2, 3, True, 2.5),
    (6, 256, 8, 4, 8, True, 2.5),  # DeepSeek-V3
    (9, 12, 3, 2, 4, True, 1.0),  # groups not a power of two
]


def route_inputs(tokens, experts, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen).to(device)
    bias = (torch.rand(experts, generator=gen) * 0.2).to(device)
    return logits, bias


@pytest.mark.parametrize("tokens,experts,n_group,topk_group,top_k,norm,scale", ROUTES)
def test_reference_route_matches_per_token_routing(device, tokens, experts, n_group, topk_group, top_k, norm, scale):
    logits, bias = route_inputs(tokens, experts, device)
    weights, ids = reference.moe_route(logits, bias, n_group, topk_group, top_k, norm, scale)
    want_w, want_ids = naive_route(logits, bias, n_group, topk_group, top_k, norm, scale)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids.long().cpu(), want_ids)  # both ordered by descending choice
    # float32 sigmoid, a sum of <= 8 weights, a divide and a scale against float64: < 10 ulps of
    # values <= 2.5, i.e. < 1e-6 absolute and relative
    torch.testing.assert_close(weights.double().cpu(), want_w.double(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("tokens,experts,n_group,topk_group,top_k,norm,scale", ROUTES[1:])
def test_reference_route_matches_transformers_router(tokens, experts, n_group, topk_group, top_k, norm, scale):
    DeepseekV3Config, hf = hf_modules()
    hidden = 32
    cfg = DeepseekV3Config(
        hidden_size=hidden,
        n_routed_experts=experts,
        n_group=n_group,
        topk_group=topk_group,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm,
        routed_scaling_factor=scale,
    )
    router = hf.DeepseekV3TopkRouter(cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, hidden, generator=gen))
        router.e_score_correction_bias.copy_(torch.rand(experts, generator=gen) * 0.2)
    x = torch.randn(tokens, hidden, generator=gen)
    logits, hf_w, hf_ids = router(x)
    weights, ids = reference.moe_route(logits, router.e_score_correction_bias, n_group, topk_group, top_k, norm, scale)
    got_w, got_ids = sort_by_id(weights, ids)
    want_w, want_ids = sort_by_id(hf_w.detach(), hf_ids)
    assert torch.equal(got_ids, want_ids)
    # the same elementwise float32 steps in another order: < 10 ulps of values <= 2.5
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("tokens,experts,n_group,topk_group,top_k,norm,scale", ROUTES)
def test_triton_route_matches_reference(device, tokens, experts, n_group, topk_group, top_k, norm, scale):
    from dsv4_kernels import triton_ops

    logits, bias = route_inputs(tokens, experts, device, seed=4)
    want_w, want_ids = reference.moe_route(logits, bias, n_group, topk_group, top_k, norm, scale)
    got_w, got_ids = triton_ops.moe_route(logits, bias, n_group, topk_group, top_k, norm, scale)
    assert got_w.dtype == torch.float32 and got_ids.dtype == torch.int32
    assert torch.equal(got_ids.cpu(), want_ids.cpu())
    # elementwise float32 (sigmoid, top-k sum of <= 8, divide, scale): < 10 ulps of values <= 2.5
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-6)


def test_triton_route_reads_bf16_logits(device):
    from dsv4_kernels import triton_ops

    logits, bias = route_inputs(11, 16, device, seed=5)
    logits = logits.to(torch.bfloat16)
    want = sort_by_id(*reference.moe_route(logits, bias, 4, 2, 3, True, 2.5))
    got = sort_by_id(*triton_ops.moe_route(logits, bias, 4, 2, 3, True, 2.5))
    assert torch.equal(got[1], want[1])
    # both read the same bf16 logits widened to float32, then as above: < 10 ulps
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)


def naive_experts(x, w13, w2, weights, ids):
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate_up = w13[e].double().cpu() @ x[t].double().cpu()
            act = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += float(weights[t, k]) * (w2[e].double().cpu() @ act)
    return out


def expert_inputs(tokens, experts, top_k, hidden, inter, dtype, device, seed=0, skip_experts=()):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    allowed = torch.tensor([e for e in range(experts) if e not in skip_experts])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:top_k]] for _ in range(tokens)]).to(
        torch.int32
    )
    weights = torch.rand(tokens, top_k, generator=gen)
    return (
        x.to(dtype).to(device),
        w13.to(dtype).to(device),
        w2.to(dtype).to(device),
        weights.to(device),
        ids.to(device),
    )


# (tokens, experts, top_k, hidden, inter, experts left without tokens)
EXPERTS = [
    (1, 8, 3, 64, 32, ()),  # decode
    (20, 4, 2, 48, 40, ()),  # sizes off the tile multiples, several M-blocks an expert
    (6, 16, 2, 32, 16, (0, 5, 6, 7, 8, 9, 15)),  # experts with no tokens
]


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter,skip", EXPERTS)
def test_reference_experts_match_per_token_sum(device, tokens, experts, top_k, hidden, inter, skip):
    x, w13, w2, w, ids = expert_inputs(tokens, experts, top_k, hidden, inter, torch.float32, device, skip_experts=skip)
    got = reference.moe_experts(x, w13, w2, w, ids)
    torch.testing.assert_close(got.double().cpu(), naive_experts(x, w13, w2, w, ids), atol=1e-5, rtol=1e-5)


def test_reference_experts_match_transformers_experts():
    DeepseekV3Config, hf = hf_modules()
    tokens, experts, top_k, hidden, inter = 9, 8, 3, 32, 24
    cfg = DeepseekV3Config(
        hidden_size=hidden, n_routed_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=inter
    )
    module = hf.DeepseekV3Experts(cfg)
    x, w13, w2, w, ids = expert_inputs(tokens, experts, top_k, hidden, inter, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        module.gate_up_proj.copy_(w13)
        module.down_proj.copy_(w2)
        want = module(x, ids.long(), w)
    torch.testing.assert_close(reference.moe_experts(x, w13, w2, w, ids), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter,skip", EXPERTS)
def test_triton_experts_match_reference(device, tol, dtype, tokens, experts, top_k, hidden, inter, skip):
    from dsv4_kernels import triton_ops

    x, w13, w2, w, ids = expert_inputs(tokens, experts, top_k, hidden, inter, dtype, device, seed=1, skip_experts=skip)
    want = reference.moe_experts(x, w13, w2, w, ids)
    got = triton_ops.moe_experts(x, w13, w2, w, ids)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), want.float(), **tol[dtype])
    # `add` (a shared expert's output) joins the result on both backends
    add = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(dtype=dtype, device=device)
    with_add = triton_ops.moe_experts(x, w13, w2, w, ids, add)
    torch.testing.assert_close(
        with_add.float(), reference.moe_experts(x, w13, w2, w, ids, add=add).float(), **tol[dtype]
    )


def test_pairs_sorted_by_expert_cover_every_pair_once_in_single_expert_blocks(device):
    from dsv4_kernels.triton_kernels.moe_experts import align_pairs_by_expert

    gen = torch.Generator().manual_seed(6)
    experts, top_k, block_m = 6, 2, 4
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(9)]).to(device)
    ids[ids == 3] = 4  # expert 3 gets nothing
    pairs, block_expert = align_pairs_by_expert(ids, experts, block_m)
    pairs, block_expert = pairs.cpu(), block_expert.cpu()
    num_pairs = ids.numel()
    real = pairs[pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))
    flat = ids.reshape(-1).cpu()
    for blk, expert in enumerate(block_expert.tolist()):
        members = pairs[blk * block_m : (blk + 1) * block_m]
        members = members[members < num_pairs]
        if expert < 0:
            assert members.numel() == 0
        else:
            assert members.numel() > 0 and bool((flat[members] == expert).all())
    assert 3 not in block_expert.tolist()


# ---- tensor parallelism: pairs of other ranks' experts (id -1) are nobody's work --------------


def _split_for_rank(ids: torch.Tensor, weights: torch.Tensor, lo: int, hi: int):
    """What ShardComm.local_experts hands a rank holding global experts lo..hi-1."""
    from dsv4_engine.parallel.sharded import ShardComm

    comm = ShardComm.__new__(ShardComm)
    comm.experts = (lo, hi)
    return comm.local_experts(weights, ids)


def test_other_ranks_pairs_are_skipped_not_computed_on_a_local_expert(device):
    """Two ranks of 4 experts each: each rank's output is the naive sum over its own pairs only,
    the two add up to the whole, and a local expert whose output overflows (here expert 0 of
    rank 0, chosen by nobody) cannot turn the other rank's pairs into NaN (0 * inf)."""
    from dsv4_kernels import triton_ops

    x, w13, w2, w, ids = expert_inputs(7, 8, 3, 32, 16, torch.float32, device, seed=3, skip_experts=(0,))
    whole = reference.moe_experts(x, w13, w2, w, ids)
    for impl in (reference.moe_experts, triton_ops.moe_experts):
        parts = []
        for lo, hi in ((0, 4), (4, 8)):
            lw, lids = _split_for_rank(ids, w, lo, hi)
            local_w13, local_w2 = w13[lo:hi].clone(), w2[lo:hi].clone()
            if lo == 0:
                local_w13[0] = float("inf")  # nobody routes to global expert 0
            assert int(((lids >= 0) & (lids < 4)).sum()) == int(((ids >= lo) & (ids < hi)).sum())
            got = impl(x, local_w13, local_w2, lw, lids)
            assert torch.isfinite(got).all(), f"{impl.__module__}: rank {lo // 4} computed another rank's pairs"
            mine = ((ids >= lo) & (ids < hi)).cpu()
            want = naive_experts(x, w13, w2, w.cpu() * mine, ids.cpu())
            torch.testing.assert_close(got.double().cpu(), want, atol=1e-4, rtol=1e-4)
            parts.append(got)
        torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-4, rtol=1e-4)


def test_blocks_hold_only_local_pairs_and_the_rest_go_to_zero_blocks(device):
    from dsv4_kernels.triton_kernels.moe_experts import ZERO_BLOCK, align_pairs_by_expert

    gen = torch.Generator().manual_seed(7)
    experts, top_k, block_m = 4, 2, 4
    ids = torch.stack([torch.randperm(8, generator=gen)[:top_k] for _ in range(16)])
    ids = torch.where(ids < experts, ids, torch.full_like(ids, -1)).to(device)  # rank 0 of 2
    pairs, block_expert = align_pairs_by_expert(ids, experts, block_m)
    pairs, block_expert, flat = pairs.cpu(), block_expert.cpu(), ids.reshape(-1).cpu()
    computed, zeroed = [], []
    for blk, expert in enumerate(block_expert.tolist()):
        members = pairs[blk * block_m : (blk + 1) * block_m]
        members = members[members < flat.numel()].tolist()
        if expert >= 0:
            assert all(int(flat[m]) == expert for m in members)
            computed += members
        elif expert == ZERO_BLOCK:
            zeroed += members
        else:
            assert not members
    assert sorted(computed) == [i for i in range(flat.numel()) if flat[i] >= 0]
    assert sorted(zeroed) == [i for i in range(flat.numel()) if flat[i] < 0]
    assert len(computed) < flat.numel() and zeroed
