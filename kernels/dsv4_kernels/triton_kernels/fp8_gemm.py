"""Block-scaled FP8 GEMMs (w8a8), as DeepSeek's inference runs its fp8 checkpoints.

Weights: e4m3 [E?, N, K] with fp32 scales per 128-wide group of K and per 128 rows (the
checkpoint's 128x128 blocks, SCALE_ROWS=128) or per row (SCALE_ROWS=1, for weights concatenated
from parts whose row counts are not multiples of 128).
Activations: quantized per token and 128-wide group of K by fp8_act_quant_kernel. The GEMM
walks K one 128-group at a time: dot(qa, qw) in fp32 times sa[m] * sw[n]. One kernel serves
- dense linears (DENSE: rows are 0..M-1, one weight), and
- routed experts: M-blocks of (token, slot) pairs sorted and padded by expert
  (moe_experts.align_pairs_by_expert), the gate/up GEMM fused with SwiGLU (GATED, with
  DeepSeek-V4's clamp when HAS_LIMIT), the down GEMM scaled by the routing weight (ROUTE_W).
K and N need not be multiples of 128: the edge groups are masked.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import KernelVariant, check_launchable, on_interpreter
from .common import fp32_twins
from .moe_experts import align_pairs_by_expert, sum_local_rows
from ..reference_quant import scale_row_block

GROUP = 128
FP8_MAX = 448.0


@triton.jit
def fp8_act_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    stride_x,
    stride_q,
    stride_s,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
):
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = g * GROUP + tl.arange(0, GROUP)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    s = tl.where(amax > 0, tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1.0)
    q = tl.clamp(tl.div_rn(x, s[:, None]), -448.0, 448.0)  # IEEE division, as torch divides
    if EXACT_ROUND:
        # The interpreter's fp32 -> e4m3 cast drops the carry when rounding up crosses a power of
        # two (124.3 -> 64). Round to the e4m3 grid here (3 mantissa bits, subnormal step 2**-9,
        # ties to even by fp32 addition) so that the cast below is exact.
        mag = tl.abs(q)
        e = tl.maximum(tl.floor(tl.log2(tl.maximum(mag, 1e-30))), -6.0)
        big = tl.exp2(e - 3.0) * 12582912.0  # 1.5 * 2**23 steps: fp32 addition rounds at one step
        mag = (mag + big) - big
        q = tl.where(q < 0, -mag, mag)
    tl.store(q_ptr + rows64[:, None] * stride_q + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows64 * stride_s + g, s, mask=rows < M)


@triton.jit
def fp8_gemm_kernel(
    a_ptr,
    a_s_ptr,
    w_ptr,
    w_s_ptr,
    out_ptr,
    route_w_ptr,
    rows_ptr,
    block_expert_ptr,
    num_rows,
    N,
    K,
    swiglu_limit,
    stride_a,
    stride_as,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_o,
    A_DIV: tl.constexpr,
    DENSE: tl.constexpr,
    GATED: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    ROUTE_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if DENSE:
        expert = tl.full([], 0, tl.int32)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    else:
        expert = tl.load(block_expert_ptr + pid_m)
        rows = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    if expert >= 0:
        r_mask = rows < num_rows
        prow = rows.to(tl.int64)  # row * stride can pass 2**31 on long prefills
        a_rows = prow // A_DIV
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        ws_base = w_s_ptr + expert.to(tl.int64) * stride_wse
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kb = k0 // BLOCK_K
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            a = tl.load(
                a_ptr + a_rows[:, None] * stride_a + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0
            )
            a_s = tl.load(a_s_ptr + a_rows * stride_as + kb, mask=r_mask, other=0.0)
            w_mask = k_mask[:, None] & n_mask[None, :]
            w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
            w_s = tl.load(ws_base + (offs_n // SCALE_ROWS) * stride_wsn + kb, mask=n_mask, other=0.0)
            if UPCAST:
                part = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(a, w)
            acc += part * a_s[:, None] * w_s[None, :]
            if GATED:
                wu = tl.load(w_base + (N + offs_n)[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
                wu_s = tl.load(ws_base + ((N + offs_n) // SCALE_ROWS) * stride_wsn + kb, mask=n_mask, other=0.0)
                if UPCAST:
                    part_up = tl.dot(a.to(tl.float32), wu.to(tl.float32), input_precision="ieee")
                else:
                    part_up = tl.dot(a, wu)
                acc_up += part_up * a_s[:, None] * wu_s[None, :]
        if GATED:
            gate = acc
            up = acc_up
            if HAS_LIMIT:
                gate = tl.minimum(gate, swiglu_limit)
                up = tl.clamp(up, -swiglu_limit, swiglu_limit)
            acc = gate * tl.sigmoid(gate) * up
        if ROUTE_W:
            acc = acc * tl.load(route_w_ptr + prow, mask=r_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(
            out_ptr + prow[:, None] * stride_o + offs_n[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=r_mask[:, None] & n_mask[None, :],
        )


def gemm_blocks(rows: int, gated: bool = False) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): small M-blocks for decode, where reading weights dominates.
    The gated GEMM holds two accumulators and two weight tiles: narrower N-tiles (at 64x64 and
    16x64 the AOT report showed spills on sm_120 and sm_100)."""
    if rows <= 16:
        return (16, 32, 4) if gated else (16, 64, 4)
    if rows <= 64:
        return (32, 64, 4) if gated else (32, 128, 4)
    return (64, 32, 8) if gated else (64, 128, 8)


def fp8_act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, ceil(K/128)]), one scale per token and 128 values."""
    check_launchable(fp8_act_quant_kernel, x)
    M, K = x.shape
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, triton.cdiv(K, GROUP), dtype=torch.float32, device=x.device)
    if M:
        block_m = 16
        fp8_act_quant_kernel[(triton.cdiv(M, block_m), triton.cdiv(K, GROUP))](
            x,
            q,
            s,
            M,
            K,
            x.stride(0),
            q.stride(0),
            s.stride(0),
            GROUP=GROUP,
            BLOCK_M=block_m,
            EXACT_ROUND=on_interpreter(x),
            num_warps=4,
        )
    return q, s


def _launch(
    a,
    a_s,
    w,
    w_s,
    out,
    route_w,
    rows,
    block_expert,
    num_rows,
    n,
    *,
    a_div,
    dense,
    gated,
    limit,
    tiles: tuple[int, int, int],
    num_m_blocks: int,
) -> None:
    block_m, block_n, warps = tiles
    fp8_gemm_kernel[(num_m_blocks, triton.cdiv(n, block_n))](
        a,
        a_s,
        w,
        w_s,
        out,
        route_w if route_w is not None else a_s,
        rows,
        block_expert,
        num_rows,
        n,
        a.shape[1],
        float(limit or 0.0),
        a.stride(0),
        a_s.stride(0),
        w.stride(0) if w.dim() == 3 else 0,
        w.stride(-2),
        w_s.stride(0) if w_s.dim() == 3 else 0,
        w_s.stride(-2),
        out.stride(0),
        A_DIV=a_div,
        DENSE=dense,
        GATED=gated,
        HAS_LIMIT=bool(limit),
        ROUTE_W=route_w is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=GROUP,
        SCALE_ROWS=scale_row_block(w, w_s),
        UPCAST=on_interpreter(a),
        num_warps=warps,
        num_stages=3,
    )


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """y = x @ W^T, x [M, K] in bf16/fp32, w e4m3 [N, K], w_scale fp32 [ceil(N/128) or N, ceil(K/128)];
    y in x's dtype."""
    check_launchable(fp8_gemm_kernel, x)
    M, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K or w_scale.shape[-1] != triton.cdiv(K, GROUP):
        raise ValueError(f"fp8_linear: x {tuple(x.shape)}, w {tuple(w.shape)}, w_scale {tuple(w_scale.shape)} disagree")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    q, s = fp8_act_quant(x)
    tiles = gemm_blocks(M)
    dummy = torch.empty(1, dtype=torch.int32, device=x.device)  # no pair list in the dense case
    _launch(
        q,
        s,
        w,
        w_scale,
        out,
        None,
        dummy,
        dummy,
        M,
        N,
        a_div=1,
        dense=True,
        gated=False,
        limit=None,
        tiles=tiles,
        num_m_blocks=triton.cdiv(M, tiles[0]),
    )
    return out


def fp8_moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: Optional[float] = None,
) -> torch.Tensor:
    """Routed experts with fp8 weights w13 [E, 2I, H], w2 [E, H, I] and per-row scales; returns
    [T, H] in x's dtype (the top_k rows of a token summed in a fixed order)."""
    check_launchable(fp8_gemm_kernel, x)
    T, H = x.shape
    E, two_i, _ = w13.shape
    inter_size = two_i // 2
    top_k = topk_ids.shape[1]
    pairs = T * top_k
    if T == 0:
        return torch.empty_like(x)
    tiles = gemm_blocks(pairs // E)
    sorted_pairs, block_expert = align_pairs_by_expert(topk_ids, E, tiles[0])
    grid = dict(tiles=tiles, num_m_blocks=block_expert.shape[0])
    gated_tiles = gemm_blocks(pairs // E, gated=True)
    xq, xs = fp8_act_quant(x)
    inter = torch.empty(pairs, inter_size, dtype=x.dtype, device=x.device)
    _launch(
        xq,
        xs,
        w13,
        s13,
        inter,
        None,
        sorted_pairs,
        block_expert,
        pairs,
        inter_size,
        a_div=top_k,
        dense=False,
        gated=True,
        limit=swiglu_limit,
        tiles=gated_tiles,
        num_m_blocks=block_expert.shape[0],
    )
    iq, is_ = fp8_act_quant(inter)
    y = torch.empty(pairs, H, dtype=torch.float32, device=x.device)
    route_w = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _launch(
        iq,
        is_,
        w2,
        s2,
        y,
        route_w,
        sorted_pairs,
        block_expert,
        pairs,
        H,
        a_div=1,
        dense=False,
        gated=False,
        limit=None,
        **grid,
    )
    return sum_local_rows(y, topk_ids, x.dtype)


def aot_variants(arch: int) -> list[KernelVariant]:
    """Activation quantization (bf16 in), the dense GEMM at decode and prefill tiles, and the two
    expert GEMMs (gated gate/up with V4's clamp, routed down) at both ends of M."""
    variants = [
        KernelVariant(
            name="fp8_act_quant[bf16]",
            kernel=fp8_act_quant_kernel,
            types={
                "x_ptr": "*bf16",
                "q_ptr": "*fp8e4nv",
                "s_ptr": "*fp32",
                "M": "i32",
                "K": "i32",
                "stride_x": "i32",
                "stride_q": "i32",
                "stride_s": "i32",
            },
            constexprs=dict(GROUP=GROUP, BLOCK_M=16, EXACT_ROUND=False),
            num_warps=4,
            num_stages=1,
            divisible=("K",),
        )
    ]
    types = {
        "a_ptr": "*fp8e4nv",
        "a_s_ptr": "*fp32",
        "w_ptr": "*fp8e4nv",
        "w_s_ptr": "*fp32",
        "out_ptr": "*bf16",
        "route_w_ptr": "*fp32",
        "rows_ptr": "*i32",
        "block_expert_ptr": "*i32",
        "num_rows": "i32",
        "N": "i32",
        "K": "i32",
        "swiglu_limit": "fp32",
        "stride_a": "i32",
        "stride_as": "i32",
        "stride_we": "i64",
        "stride_wn": "i32",
        "stride_wse": "i32",
        "stride_wsn": "i32",
        "stride_o": "i32",
    }
    for rows, label in ((8, "decode"), (4096, "prefill")):
        bm, bn, warps = gemm_blocks(rows)
        shapes = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=GROUP, SCALE_ROWS=GROUP, UPCAST=False)
        gated_shapes = {**shapes, "BLOCK_N": gemm_blocks(rows, gated=True)[1]}
        variants.append(
            KernelVariant(
                name=f"fp8_gemm[bf16,dense,{label}]",
                kernel=fp8_gemm_kernel,
                types=types,
                constexprs=dict(A_DIV=1, DENSE=True, GATED=False, HAS_LIMIT=False, ROUTE_W=False, **shapes),
                num_warps=warps,
                num_stages=3,
                divisible=("N", "K"),
            )
        )
        variants.append(
            KernelVariant(
                name=f"fp8_gemm[bf16,moe_gate_up,{label}]",
                kernel=fp8_gemm_kernel,
                types=types,
                constexprs=dict(A_DIV=8, DENSE=False, GATED=True, HAS_LIMIT=True, ROUTE_W=False, **gated_shapes),
                num_warps=warps,
                num_stages=3,
                divisible=("N", "K"),
            )
        )
        variants.append(
            KernelVariant(
                name=f"fp8_gemm[bf16,moe_down,{label}]",
                kernel=fp8_gemm_kernel,
                types={**types, "out_ptr": "*fp32"},
                constexprs=dict(A_DIV=1, DENSE=False, GATED=False, HAS_LIMIT=False, ROUTE_W=True, **shapes),
                num_warps=warps,
                num_stages=3,
                divisible=("N", "K"),
            )
        )
    return fp32_twins(variants)  # x in fp32: only the output dtype changes (activations go to fp8)
