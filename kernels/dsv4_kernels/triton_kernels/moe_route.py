"""DeepSeek-V3 ``noaux_tc`` routing in one kernel: sigmoid, bias correction, group scores (sum
of each group's top two), top groups, then top experts within them, renormalised and scaled.

A program holds BLOCK_T tokens' logits as a [token, group, expert-in-group] tile, so group
reductions are axis reductions; the top-k selections are repeated arg-max passes that knock
out each winner (k is small: 4 groups, 8 experts for V3). Ties go to the lower index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import KernelVariant, check_launchable, next_pow2


@triton.jit
def moe_route_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens,
    stride_l_t,
    stride_w_t,
    stride_i_t,
    scaling,
    N_GROUP: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    NORM_TOPK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = tokens < num_tokens
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_E)
    cell = (g[:, None] < N_GROUP) & (j[None, :] < GROUP_SIZE)  # [G, E]: a real expert
    expert = g[:, None] * GROUP_SIZE + j[None, :]

    logits = tl.load(
        logits_ptr + tokens[:, None, None].to(tl.int64) * stride_l_t + expert[None, :, :],
        mask=t_mask[:, None, None] & cell[None, :, :],
        other=0.0,
    ).to(tl.float32)
    scores = tl.sigmoid(logits)
    bias = tl.load(bias_ptr + expert, mask=cell, other=0.0).to(tl.float32)
    choice = tl.where(cell[None, :, :], scores + bias[None, :, :], float("-inf"))

    # Group score = sum of the group's two best choice values.
    top1 = tl.max(choice, 2)
    arg1 = tl.argmax(choice, 2)
    top2 = tl.max(tl.where(j[None, None, :] == arg1[:, :, None], float("-inf"), choice), 2)
    group_score = tl.where(g[None, :] < N_GROUP, top1 + top2, float("-inf"))
    kept = tl.zeros([BLOCK_T, BLOCK_G], dtype=tl.int1)
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.argmax(group_score, 1)
        hit = g[None, :] == best[:, None]
        kept = kept | hit
        group_score = tl.where(hit, float("-inf"), group_score)

    cand = tl.where(kept[:, :, None] & cell[None, :, :], choice, float("-inf"))
    cand = tl.reshape(cand, [BLOCK_T, BLOCK_G * BLOCK_E])
    flat_scores = tl.reshape(scores, [BLOCK_T, BLOCK_G * BLOCK_E])
    flat = tl.arange(0, BLOCK_G * BLOCK_E)
    kk = tl.arange(0, BLOCK_K)
    out_w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    out_id = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.argmax(cand, 1)
        hit = flat[None, :] == best[:, None]
        w = tl.sum(tl.where(hit, flat_scores, 0.0), 1)  # the score WITHOUT bias
        eid = (best // BLOCK_E) * GROUP_SIZE + best % BLOCK_E
        out_w = tl.where(kk[None, :] == i, w[:, None], out_w)
        out_id = tl.where(kk[None, :] == i, eid[:, None].to(tl.int32), out_id)
        cand = tl.where(hit, float("-inf"), cand)

    if NORM_TOPK:
        out_w = out_w / (tl.sum(out_w, 1)[:, None] + 1e-20)
    out_w = out_w * scaling
    o_mask = t_mask[:, None] & (kk[None, :] < TOP_K)
    tl.store(weights_ptr + tokens[:, None] * stride_w_t + kk[None, :], out_w, mask=o_mask)
    tl.store(ids_ptr + tokens[:, None] * stride_i_t + kk[None, :], out_id, mask=o_mask)


def _block_t(num_experts: int) -> int:
    # About 1k routing cells a program: ~56 registers a thread for 256 experts (AOT report).
    return max(1, min(64, 1024 // next_pow2(num_experts)))


def moe_route(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    n_group: int,
    topk_group: int,
    top_k: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_launchable(moe_route_kernel, router_logits)
    num_tokens, num_experts = router_logits.shape
    if num_experts % n_group or num_experts // n_group < 2:
        raise ValueError(f"{num_experts} experts do not split into {n_group} groups of two or more")
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    block_t = _block_t(num_experts)
    moe_route_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits,
        correction_bias.contiguous(),
        weights,
        ids,
        num_tokens,
        router_logits.stride(0),
        weights.stride(0),
        ids.stride(0),
        float(routed_scaling_factor),
        N_GROUP=n_group,
        GROUP_SIZE=num_experts // n_group,
        TOPK_GROUP=topk_group,
        TOP_K=top_k,
        NORM_TOPK=bool(norm_topk_prob),
        BLOCK_T=block_t,
        BLOCK_G=next_pow2(n_group),
        BLOCK_E=next_pow2(num_experts // n_group),
        BLOCK_K=next_pow2(top_k),
        num_warps=4,
    )
    return weights, ids


def aot_variants(arch: int) -> list[KernelVariant]:
    """DeepSeek-V3's routing: 256 experts in 8 groups, 4 groups kept, 8 experts chosen."""
    return [
        KernelVariant(
            name="moe_route[fp32,e256,g8]",
            kernel=moe_route_kernel,
            types={
                "logits_ptr": "*fp32",
                "bias_ptr": "*fp32",
                "weights_ptr": "*fp32",
                "ids_ptr": "*i32",
                "num_tokens": "i32",
                "stride_l_t": "i32",
                "stride_w_t": "i32",
                "stride_i_t": "i32",
                "scaling": "fp32",
            },
            constexprs=dict(
                N_GROUP=8,
                GROUP_SIZE=32,
                TOPK_GROUP=4,
                TOP_K=8,
                NORM_TOPK=True,
                BLOCK_T=_block_t(256),
                BLOCK_G=8,
                BLOCK_E=32,
                BLOCK_K=8,
            ),
            num_warps=4,
            num_stages=1,
        )
    ]
