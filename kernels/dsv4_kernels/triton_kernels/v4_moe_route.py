"""DeepSeek-V4 MoE routing in one kernel: scores sqrt(softplus(logit)) (or sigmoid), then either
the top-k of score + correction bias (learned routing, no expert groups in V4) or the experts a
token id maps to (hash routing, tid2eid), then the chosen scores renormalised and scaled.

A program holds BLOCK_T tokens' logits as one [token, expert] tile; top-k is k arg-max passes
that knock out each winner (k is 6 for V4), ties to the lower expert.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import KernelVariant, check_launchable, next_pow2


@triton.jit
def v4_moe_route_kernel(
    logits_ptr,
    bias_ptr,
    tid2eid_ptr,
    input_ids_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens,
    num_experts,
    stride_l_t,
    stride_h_v,
    stride_w_t,
    stride_i_t,
    scaling,
    TOP_K: tl.constexpr,
    HASH: tl.constexpr,
    SQRT_SOFTPLUS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = tokens < num_tokens
    e = tl.arange(0, BLOCK_E)
    e_mask = e < num_experts
    x = tl.load(
        logits_ptr + tokens[:, None].to(tl.int64) * stride_l_t + e[None, :],
        mask=t_mask[:, None] & e_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    if SQRT_SOFTPLUS:
        # softplus as torch computes it: x past 20, exp(x) far below 0 (where log(1 + exp) rounds to 0)
        sp = tl.where(x > 20.0, x, tl.where(x < -15.0, tl.exp(x), tl.log(1.0 + tl.exp(x))))
        scores = tl.sqrt(sp)
    else:
        scores = tl.sigmoid(x)
    kk = tl.arange(0, BLOCK_K)
    out_w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    out_id = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    if HASH:
        ids_in = tl.load(input_ids_ptr + tokens, mask=t_mask, other=0).to(tl.int64)
        for i in tl.static_range(TOP_K):
            eid = tl.load(tid2eid_ptr + ids_in * stride_h_v + i, mask=t_mask, other=0).to(tl.int32)
            w = tl.sum(tl.where(e[None, :] == eid[:, None], scores, 0.0), 1)
            out_w = tl.where(kk[None, :] == i, w[:, None], out_w)
            out_id = tl.where(kk[None, :] == i, eid[:, None], out_id)
    else:
        bias = tl.load(bias_ptr + e, mask=e_mask, other=0.0).to(tl.float32)
        cand = tl.where(e_mask[None, :], scores + bias[None, :], float("-inf"))
        for i in tl.static_range(TOP_K):
            best = tl.argmax(cand, 1)
            hit = e[None, :] == best[:, None]
            w = tl.sum(tl.where(hit, scores, 0.0), 1)  # the score WITHOUT bias
            out_w = tl.where(kk[None, :] == i, w[:, None], out_w)
            out_id = tl.where(kk[None, :] == i, best[:, None].to(tl.int32), out_id)
            cand = tl.where(hit, float("-inf"), cand)
    out_w = out_w / (tl.sum(out_w, 1)[:, None] + 1e-20) * scaling
    o_mask = t_mask[:, None] & (kk[None, :] < TOP_K)
    tl.store(weights_ptr + tokens[:, None] * stride_w_t + kk[None, :], out_w, mask=o_mask)
    tl.store(ids_ptr + tokens[:, None] * stride_i_t + kk[None, :], out_id, mask=o_mask)


def _block_t(num_experts: int) -> int:
    return max(1, min(64, 2048 // next_pow2(num_experts)))


def v4_moe_route(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    tid2eid: torch.Tensor | None,
    input_ids: torch.Tensor,
    top_k: int,
    routed_scaling_factor: float,
    scoring_func: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_launchable(v4_moe_route_kernel, router_logits)
    num_tokens, num_experts = router_logits.shape
    if scoring_func not in ("sqrtsoftplus", "sigmoid"):
        raise ValueError(f"unsupported scoring_func {scoring_func!r}")
    if tid2eid is None and correction_bias is None:
        raise ValueError("v4_moe_route needs a correction bias (learned routing) or tid2eid (hash routing)")
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    dev = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=dev)
    if num_tokens == 0:
        return weights, ids
    hashed = tid2eid is not None
    table = tid2eid.to(torch.int32).contiguous() if hashed else ids
    bias = correction_bias.float().contiguous() if correction_bias is not None else weights
    block_t = _block_t(num_experts)
    v4_moe_route_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits,
        bias,
        table,
        input_ids.to(dev).contiguous(),
        weights,
        ids,
        num_tokens,
        num_experts,
        router_logits.stride(0),
        table.stride(0) if hashed else 0,
        weights.stride(0),
        ids.stride(0),
        float(routed_scaling_factor),
        TOP_K=top_k,
        HASH=hashed,
        SQRT_SOFTPLUS=scoring_func == "sqrtsoftplus",
        BLOCK_T=block_t,
        BLOCK_E=next_pow2(num_experts),
        BLOCK_K=next_pow2(top_k),
        num_warps=4,
    )
    return weights, ids


def aot_variants(arch: int) -> list[KernelVariant]:
    """V4-Flash's routing: 256 experts, top-6, learned and hash-routed; the logits come in the
    engine's dtype (the gate is a plain linear of the hidden state), the bias in fp32."""
    variants = []
    for dtype, hashed in (("fp32", False), ("fp32", True), ("bf16", False), ("bf16", True)):
        variants.append(
            KernelVariant(
                name=f"v4_moe_route[{dtype},e256,k6,{'hash' if hashed else 'learned'}]",
                kernel=v4_moe_route_kernel,
                types={
                    "logits_ptr": f"*{dtype}",
                    "bias_ptr": "*fp32",
                    "tid2eid_ptr": "*i32",
                    "input_ids_ptr": "*i64",
                    "weights_ptr": "*fp32",
                    "ids_ptr": "*i32",
                    "num_tokens": "i32",
                    "num_experts": "i32",
                    "stride_l_t": "i32",
                    "stride_h_v": "i32",
                    "stride_w_t": "i32",
                    "stride_i_t": "i32",
                    "scaling": "fp32",
                },
                constexprs=dict(
                    TOP_K=6, HASH=hashed, SQRT_SOFTPLUS=True, BLOCK_T=_block_t(256), BLOCK_E=256, BLOCK_K=8
                ),
                num_warps=4,
                num_stages=1,
            )
        )
    return variants
