"""Routed experts as two fused grouped GEMMs over (token, slot) pairs sorted by expert.

The launcher sorts the T*top_k pairs by expert and pads each expert's run to a multiple of
BLOCK_M, so every M-block belongs to one expert (all on the device, no host sync; the grid
covers the worst-case padding and spare blocks exit at once). Then:
1. gate/up GEMM with SiLU(gate) * up fused in the epilogue -> intermediate [pairs, I];
2. down GEMM scaled by each pair's routing weight -> [pairs, hidden] in fp32,
and the top_k rows of each token are summed (a fixed-order reduction: deterministic).

Pairs whose expert id is -1 (another rank's expert under tensor parallelism) are computed by
nobody: they sit in one run of their own after the local experts' runs, whose blocks
(ZERO_BLOCK) exit at once, and their rows of the per-pair output are never written: the sum
(moe_sum_local_kernel) reads a token's local pairs only. At TP 8 about 7/8 of the pairs are
other ranks', so neither the GEMM nor the sum touches their rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import KernelVariant, check_launchable, fp32_twins, on_interpreter

# block_expert of the blocks holding other ranks' pairs: no GEMM, no rows written.
# (-1: spare blocks past the last run, which do nothing.) Kernels spell it as the literal -2.
ZERO_BLOCK = -2


@triton.jit
def moe_gate_up_kernel(
    x_ptr,
    w13_ptr,
    inter_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    hidden,
    inter_size,
    swiglu_limit,
    stride_x_t,
    stride_w_e,
    stride_w_n,
    stride_i_p,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CLAMP: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= 0:
        pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        p_mask = pairs < num_pairs
        tokens = pairs // TOP_K
        pairs = pairs.to(tl.int64)  # pairs * row stride can pass 2**31 on long prefills
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < inter_size
        w_base = w13_ptr + expert.to(tl.int64) * stride_w_e
        gate_cols = w_base + offs_n[None, :] * stride_w_n
        up_cols = w_base + (inter_size + offs_n)[None, :] * stride_w_n
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < hidden
            a = tl.load(
                x_ptr + tokens[:, None] * stride_x_t + offs_k[None, :],
                mask=p_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            w_mask = k_mask[:, None] & n_mask[None, :]
            wg = tl.load(gate_cols + offs_k[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
            wu = tl.load(up_cols + offs_k[:, None], mask=w_mask, other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                wg = wg.to(tl.float32)
                wu = wu.to(tl.float32)
            acc_gate = tl.dot(a, wg, acc_gate, input_precision="ieee")
            acc_up = tl.dot(a, wu, acc_up, input_precision="ieee")
        if CLAMP:  # DeepSeek-V4's SwiGLU: gate clipped from above, up to [-limit, limit]
            acc_gate = tl.minimum(acc_gate, swiglu_limit)
            acc_up = tl.minimum(tl.maximum(acc_up, -swiglu_limit), swiglu_limit)
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up
        tl.store(
            inter_ptr + pairs[:, None] * stride_i_p + offs_n[None, :],
            act.to(inter_ptr.dtype.element_ty),
            mask=p_mask[:, None] & n_mask[None, :],
        )


@triton.jit
def moe_down_kernel(
    inter_ptr,
    w2_ptr,
    topk_weights_ptr,
    y_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    hidden,
    inter_size,
    stride_i_p,
    stride_w_e,
    stride_w_n,
    stride_y_p,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    p_mask = pairs < num_pairs
    pairs = pairs.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    if expert >= 0:
        w_cols = w2_ptr + expert.to(tl.int64) * stride_w_e + offs_n[None, :] * stride_w_n
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, inter_size, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < inter_size
            a = tl.load(
                inter_ptr + pairs[:, None] * stride_i_p + offs_k[None, :],
                mask=p_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            w = tl.load(w_cols + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision="ieee")
        route_w = tl.load(topk_weights_ptr + pairs, mask=p_mask, other=0.0).to(tl.float32)
        acc = acc * route_w[:, None]
        tl.store(y_ptr + pairs[:, None] * stride_y_p + offs_n[None, :], acc, mask=p_mask[:, None] & n_mask[None, :])


@triton.jit
def moe_sum_local_kernel(
    y_ptr,
    ids_ptr,
    add_ptr,
    out_ptr,
    hidden,
    stride_y_p,
    stride_add_t,
    stride_o_t,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_ADD: tl.constexpr,
):
    """out[t] = sum over t's pairs routed to a local expert (id >= 0) of y[pair], in slot order
    (deterministic), in out's dtype, plus add[t]. Rows of other ranks' pairs are not read."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h < hidden
    acc = tl.zeros([BLOCK_H], tl.float32)
    for k in tl.static_range(TOP_K):
        if tl.load(ids_ptr + t * TOP_K + k) >= 0:
            acc += tl.load(y_ptr + (t * TOP_K + k) * stride_y_p + h, mask=h_mask, other=0.0)
    out = acc.to(out_ptr.dtype.element_ty)
    if HAS_ADD:  # the shared expert's output, added in out's dtype as torch would
        out = (out.to(tl.float32) + tl.load(add_ptr + t * stride_add_t + h, mask=h_mask).to(tl.float32)).to(
            out_ptr.dtype.element_ty
        )
    tl.store(out_ptr + t * stride_o_t + h, out, mask=h_mask)


def sum_local_rows(y: torch.Tensor, topk_ids: torch.Tensor, dtype: torch.dtype, add: torch.Tensor | None = None):
    """[T, hidden] in dtype: each token's weighted expert rows y [T * top_k, hidden] (fp32) over
    its local pairs only (the rows of pairs with id -1 may hold anything: nobody wrote them)."""
    T, top_k = topk_ids.shape
    hidden = y.shape[1]
    if add is not None and (add.dtype != dtype or add.shape != (T, hidden)):
        return sum_local_rows(y, topk_ids, dtype) + add  # torch's promotion and broadcasting
    if add is not None and add.stride(-1) != 1:
        add = add.contiguous()
    out = torch.empty(T, hidden, dtype=dtype, device=y.device)
    if T == 0:
        return out
    ids = topk_ids.to(torch.int32).contiguous()
    block_h = min(1024, triton.next_power_of_2(hidden))
    moe_sum_local_kernel[(T, triton.cdiv(hidden, block_h))](
        y,
        ids,
        add if add is not None else out,
        out,
        hidden,
        y.stride(0),
        add.stride(0) if add is not None else 0,
        out.stride(0),
        TOP_K=top_k,
        BLOCK_H=block_h,
        HAS_ADD=add is not None,
        num_warps=4,
    )
    return out


@dataclass(frozen=True)
class ExpertsConfig:
    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


def experts_config(num_pairs: int, num_experts: int, elem_size: int = 2) -> ExpertsConfig:
    """Small M-blocks when experts get few rows each (decode): the padding is wasted work and the
    GEMM is bound by reading weights anyway. fp32 halves the K-tiles to fit sm_120's ~99 KiB of
    shared memory without spilling (AOT report)."""
    rows_per_expert = num_pairs / max(1, num_experts)
    if elem_size > 2:
        if rows_per_expert <= 16:
            return ExpertsConfig(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=3)
        if rows_per_expert <= 64:
            return ExpertsConfig(block_m=32, block_n=64, block_k=32, num_warps=4, num_stages=3)
        return ExpertsConfig(block_m=64, block_n=64, block_k=32, num_warps=8, num_stages=3)
    if rows_per_expert <= 16:
        return ExpertsConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
    if rows_per_expert <= 64:
        return ExpertsConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=3)
    return ExpertsConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)


def align_pairs_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort (token, slot) pairs by expert and pad each expert's run to a multiple of block_m.

    Returns sorted_pairs [num_blocks * block_m] (flat pair index t * top_k + k; padding holds
    num_pairs) and block_expert [num_blocks] (the block's expert, -1 past the last block used,
    ZERO_BLOCK for the run of pairs with id -1: another rank's expert). Ids are in
    [0, num_experts) or -1.
    num_blocks is the worst case, known from shapes alone: nothing here waits on the device.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    device = flat.device
    # Other ranks' pairs (id -1) form one last run, "expert" E: -1 mod (E + 1) = E, one op (a
    # decode layer's dispatches are budgeted, see cuda_graphs.DECODE_DISPATCHES_PER_LAYER).
    runs = num_experts + 1
    flat = flat.remainder(runs)
    # scatter_add, not bincount: bincount reads the max id back to the host, which would
    # break CUDA-graph capture of decode steps.
    counts = torch.zeros(runs, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    run_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=device) - run_start[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank
    num_blocks = triton.cdiv(num_pairs + min(runs, num_pairs) * (block_m - 1), block_m)
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    # Run E (other ranks' pairs) -> ZERO_BLOCK (-2), past the last run (E + 1) -> -1.
    block_expert = torch.where(block_expert < num_experts, block_expert, block_expert - (num_experts + 2))
    block_expert = block_expert.to(torch.int32)
    return sorted_pairs, block_expert


def down_rows(inter, w2, weights, y, sorted_pairs, block_expert, cfg: ExpertsConfig) -> None:
    """y[pair] = weight * (inter[pair] @ w2[expert]^T) for the local experts' pairs only (fp32)."""
    num_pairs, inter_size = inter.shape
    hidden = y.shape[1]
    moe_down_kernel[(block_expert.shape[0], triton.cdiv(hidden, cfg.block_n))](
        inter,
        w2,
        weights,
        y,
        sorted_pairs,
        block_expert,
        num_pairs,
        hidden,
        inter_size,
        inter.stride(0),
        w2.stride(0),
        w2.stride(1),
        y.stride(0),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        UPCAST=on_interpreter(inter),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    add: torch.Tensor | None = None,
    *,
    swiglu_limit: float = 0.0,
    config: ExpertsConfig | None = None,
) -> torch.Tensor:
    """swiglu_limit > 0 clamps as DeepSeek-V4 does (see reference_v4.v4_moe_experts). `add`
    [T, hidden] in x's dtype (a shared expert's output) is added to the result, as the torch
    backend's moe_experts does."""
    check_launchable(moe_gate_up_kernel, x)
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter_size = two_inter // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_tokens == 0:
        return torch.empty_like(x) if add is None else add.clone()
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        if t.stride(-1) != 1:
            raise ValueError(f"moe_experts needs the last dim of {name} contiguous")
        if t.dtype != x.dtype:
            raise ValueError(f"moe_experts: {name} is {t.dtype} but x is {x.dtype}")
    cfg = config or experts_config(num_pairs, num_experts, x.element_size())
    sorted_pairs, block_expert = align_pairs_by_expert(topk_ids, num_experts, cfg.block_m)
    num_blocks = block_expert.shape[0]
    upcast = on_interpreter(x)

    inter = torch.empty(num_pairs, inter_size, dtype=x.dtype, device=x.device)
    moe_gate_up_kernel[(num_blocks, triton.cdiv(inter_size, cfg.block_n))](
        x,
        w13,
        inter,
        sorted_pairs,
        block_expert,
        num_pairs,
        hidden,
        inter_size,
        float(swiglu_limit),
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        inter.stride(0),
        TOP_K=top_k,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        CLAMP=swiglu_limit > 0,
        UPCAST=upcast,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    down_rows(inter, w2, weights, y, sorted_pairs, block_expert, cfg)
    return sum_local_rows(y, topk_ids, x.dtype, add)


def aot_variants(arch: int) -> list[KernelVariant]:
    """Experts at both ends of the M range (decode and prefill tiles), in bf16 and fp32, with
    DeepSeek-V3's top-8; and DeepSeek-V4's clamped SwiGLU with top-6."""
    variants = []
    for dtype, pairs, label, top_k, clamp in (
        ("bf16", 8, "decode", 8, False),
        ("bf16", 65536, "prefill", 8, False),
        ("fp32", 8, "decode", 8, False),
        ("fp32", 65536, "prefill", 8, False),
        ("bf16", 6, "v4,decode", 6, True),
        ("bf16", 49152, "v4,prefill", 6, True),
        ("fp32", 6, "v4,decode", 6, True),
        ("fp32", 49152, "v4,prefill", 6, True),
    ):
        cfg = experts_config(pairs, 256, 4 if dtype == "fp32" else 2)
        label = f"{dtype},{label}"
        common = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        variants.append(
            KernelVariant(
                name=f"moe_gate_up[{label}]",
                kernel=moe_gate_up_kernel,
                types={
                    "x_ptr": f"*{dtype}",
                    "w13_ptr": f"*{dtype}",
                    "inter_ptr": f"*{dtype}",
                    "sorted_pairs_ptr": "*i32",
                    "block_expert_ptr": "*i32",
                    "num_pairs": "i32",
                    "hidden": "i32",
                    "inter_size": "i32",
                    "swiglu_limit": "fp32",
                    "stride_x_t": "i32",
                    "stride_w_e": "i64",
                    "stride_w_n": "i32",
                    "stride_i_p": "i32",
                },
                constexprs=dict(
                    TOP_K=top_k,
                    BLOCK_M=cfg.block_m,
                    BLOCK_N=cfg.block_n,
                    BLOCK_K=cfg.block_k,
                    CLAMP=clamp,
                    UPCAST=False,
                ),
                divisible=("hidden", "inter_size"),
                **common,
            )
        )
        if clamp:
            continue  # the down GEMM does not depend on the activation: compiled above
        variants.append(
            KernelVariant(
                name=f"moe_down[{label}]",
                kernel=moe_down_kernel,
                types={
                    "inter_ptr": f"*{dtype}",
                    "w2_ptr": f"*{dtype}",
                    "topk_weights_ptr": "*fp32",
                    "y_ptr": "*fp32",
                    "sorted_pairs_ptr": "*i32",
                    "block_expert_ptr": "*i32",
                    "num_pairs": "i32",
                    "hidden": "i32",
                    "inter_size": "i32",
                    "stride_i_p": "i32",
                    "stride_w_e": "i64",
                    "stride_w_n": "i32",
                    "stride_y_p": "i32",
                },
                constexprs=dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, UPCAST=False),
                divisible=("hidden", "inter_size"),
                **common,
            )
        )
    sums = [
        KernelVariant(
            name=f"moe_sum_local[bf16,{label}]",
            kernel=moe_sum_local_kernel,
            types={
                "y_ptr": "*fp32",
                "ids_ptr": "*i32",
                "add_ptr": "*bf16",
                "out_ptr": "*bf16",
                "hidden": "i32",
                "stride_y_p": "i32",
                "stride_add_t": "i32",
                "stride_o_t": "i32",
            },
            constexprs=dict(TOP_K=top_k, BLOCK_H=1024, HAS_ADD=has_add),
            divisible=("hidden",),
            num_warps=4,
            num_stages=1,
        )
        for label, top_k, has_add in (("v3,shared", 8, True), ("v4", 6, False))
    ]
    return variants + fp32_twins(sums)
