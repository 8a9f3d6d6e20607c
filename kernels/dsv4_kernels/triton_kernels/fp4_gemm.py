"""FP4 (e2m1) weight GEMMs with power-of-two group scales (w4a16), for DeepSeek-V4's routed experts.

Weights: e2m1 codes packed two per byte along K (element 2j in the low nibble, 2j+1 in the high
one), uint8 [E?, N, K/2], and one e8m0 exponent byte per row and 32 values of K, [E?, N, K/32]
(scale 2**(e-127)). Activations stay in their dtype: each weight tile is decoded in registers
(e2m1 x 2**k is exact in bf16) and split into its even and odd K columns, which meet the even
and odd columns of the activations in two dots. The same launch shapes as fp8_gemm: dense
linears, and expert-sorted pair blocks with the SwiGLU (optionally clamped) and routing-weight
epilogues. K must be even (a multiple of 32 in checkpoints); N and K need not be multiples of
the tiles.
"""

from __future__ import annotations

import itertools
from typing import Optional

import torch
import triton
import triton.language as tl
from dsv4_wire import switches

from .common import KernelVariant, check_launchable, cuda_arch, on_interpreter
from .fp8_gemm import gemm_blocks
from .moe_experts import align_pairs_by_expert, sum_local_rows

GROUP = 32
BLOCK_K = 64  # logical K per step: 32 packed bytes, two scale groups


@triton.jit
def _e2m1(code):
    """e2m1 codes (int32, 0..15) -> fp32 values."""
    mag = code & 7
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    v = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * tl.exp2((e - 1).to(tl.float32)))
    return tl.where((code & 8) != 0, -v, v)


@triton.jit
def fp4_gemm_kernel(
    a_ptr,
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
    GROUP: tl.constexpr,
    UPCAST: tl.constexpr,
    NATIVE: tl.constexpr,
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
        HALF: tl.constexpr = BLOCK_K // 2
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_j = k0 // 2 + tl.arange(0, HALF)  # packed byte columns
            j_mask = offs_j < K // 2
            w_mask = j_mask[:, None] & n_mask[None, :]
            if NATIVE:  # bf16 activations x packed e2m1 + e8m0 scales, decoded by the compiler's dot
                offs_k = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(
                    a_ptr + a_rows[:, None] * stride_a + offs_k[None, :],
                    mask=r_mask[:, None] & (offs_k < K)[None, :],
                    other=0.0,
                )
                groups = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
                for half in tl.static_range(2 if GATED else 1):
                    cols = offs_n + half * N
                    packed = tl.load(w_base + cols[None, :] * stride_wn + offs_j[:, None], mask=w_mask, other=0)
                    exps = tl.load(
                        ws_base + cols[:, None] * stride_wsn + groups[None, :],
                        mask=n_mask[:, None] & (groups < tl.cdiv(K, GROUP))[None, :],
                        other=127,
                    )  # [BLOCK_N, BLOCK_K / GROUP], as dot_scaled takes a right-hand side's scales
                    if half == 0:
                        acc = tl.dot_scaled(a, None, "bf16", packed, exps, "e2m1", acc)
                    else:
                        acc_up = tl.dot_scaled(a, None, "bf16", packed, exps, "e2m1", acc_up)
            else:
                a_mask = r_mask[:, None] & j_mask[None, :]
                a_row_ptr = a_ptr + a_rows[:, None] * stride_a + 2 * offs_j[None, :]
                a_even = tl.load(a_row_ptr, mask=a_mask, other=0.0)
                a_odd = tl.load(a_row_ptr + 1, mask=a_mask, other=0.0)
                group = (2 * offs_j) // GROUP
                for half in tl.static_range(2 if GATED else 1):
                    cols = offs_n + half * N
                    packed = tl.load(w_base + cols[None, :] * stride_wn + offs_j[:, None], mask=w_mask, other=0).to(
                        tl.int32
                    )
                    exps = tl.load(ws_base + cols[None, :] * stride_wsn + group[:, None], mask=w_mask, other=127)
                    scale = tl.exp2(exps.to(tl.float32) - 127.0)
                    w_even = _e2m1(packed & 15) * scale  # [HALF, BLOCK_N]
                    w_odd = _e2m1(packed >> 4) * scale
                    if UPCAST:
                        part = tl.dot(a_even.to(tl.float32), w_even, input_precision="ieee")
                        part = tl.dot(a_odd.to(tl.float32), w_odd, part, input_precision="ieee")
                    else:
                        part = tl.dot(a_even, w_even.to(a_even.dtype), input_precision="ieee")
                        part = tl.dot(a_odd, w_odd.to(a_odd.dtype), part, input_precision="ieee")
                    if half == 0:
                        acc += part
                    else:
                        acc_up += part
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


def fp4_blocks(rows: int, gated: bool = False, elem_size: int = 2) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps). bf16 activations: fp8_gemm's tiles. fp32 activations
    (float32 engines) make the dots FMA work on fp32 tiles, which spilled 312-4,888 bytes a
    thread at those tiles, and still 32-320 at 16-32 rows on 4 warps (AOT report): 16-row tiles on
    8 warps at every size (the same BLOCK_M gated or not: the pairs are aligned on it once for
    both expert GEMMs)."""
    if elem_size <= 2:
        return gemm_blocks(rows, gated)
    return (16, 16, 8) if gated else (16, 32, 8)


# Where the tl.dot_scaled path is taken: sm_100's tile family (compute capability 10.x/11.x,
# see common.tile_target), where the AOT report shows Triton lowering a bf16 x e2m1 scaled dot
# to the hardware's fp4 conversion feeding tcgen05. Elsewhere (sm_90, sm_120, the interpreter,
# which has no dot_scaled) the registers decode stays, and fp32 activations (exact products,
# not a format dot_scaled takes) keep it everywhere.
NATIVE_ARCHS = frozenset({100})


def fp4_native(arch: int | None, dtype: torch.dtype, disabled: bool = False) -> bool:
    """Whether an fp4 GEMM with activations of `dtype` on AOT target `arch` (None off CUDA)
    takes the dot_scaled path; `disabled` (DSV4_FP4_NATIVE=0) keeps the decode path anywhere."""
    return not disabled and arch in NATIVE_ARCHS and dtype == torch.bfloat16


def _native(a: torch.Tensor) -> bool:
    return fp4_native(cuda_arch(a.device), a.dtype, switches.read("DSV4_FP4_NATIVE") == "0")


def _launch(
    a,
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
    fp4_gemm_kernel[(num_m_blocks, triton.cdiv(n, block_n))](
        a,
        w,
        w_s,
        out,
        route_w if route_w is not None else out,
        rows,
        block_expert,
        num_rows,
        n,
        a.shape[1],
        float(limit or 0.0),
        a.stride(0),
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
        BLOCK_K=BLOCK_K,
        GROUP=GROUP,
        UPCAST=on_interpreter(a),
        NATIVE=_native(a),
        num_warps=warps,
        num_stages=3,
    )


def _check(w: torch.Tensor, w_scale: torch.Tensor, K: int) -> None:
    if K % 2 or w.shape[-1] != K // 2 or w_scale.shape[-1] != triton.cdiv(K, GROUP) or w.dtype != torch.uint8:
        raise ValueError(f"fp4 weights {tuple(w.shape)} {w.dtype} / scales {tuple(w_scale.shape)} do not fit K={K}")


def fp4_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """y = x @ W^T, x [M, K], w packed uint8 [N, K/2], w_scale e8m0 bytes [N, K/32]; y in x's dtype."""
    check_launchable(fp4_gemm_kernel, x)
    M, K = x.shape
    _check(w, w_scale, K)
    N = w.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    tiles = fp4_blocks(M, elem_size=x.element_size())
    dummy = torch.empty(1, dtype=torch.int32, device=x.device)
    _launch(
        x,
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


def fp4_moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: Optional[float] = None,
) -> torch.Tensor:
    """Routed experts with packed fp4 weights w13 [E, 2I, H/2], w2 [E, H, I/2] and e8m0 scales."""
    check_launchable(fp4_gemm_kernel, x)
    T, H = x.shape
    E, two_i, _ = w13.shape
    inter_size = two_i // 2
    _check(w13, s13, H)
    _check(w2, s2, inter_size)
    top_k = topk_ids.shape[1]
    pairs = T * top_k
    if T == 0:
        return torch.empty_like(x)
    tiles = fp4_blocks(pairs // E, elem_size=x.element_size())
    sorted_pairs, block_expert = align_pairs_by_expert(topk_ids, E, tiles[0])
    grid = dict(tiles=tiles, num_m_blocks=block_expert.shape[0])
    inter = torch.empty(pairs, inter_size, dtype=x.dtype, device=x.device)
    _launch(
        x,
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
        tiles=fp4_blocks(pairs // E, gated=True, elem_size=x.element_size()),
        num_m_blocks=block_expert.shape[0],
    )
    y = torch.empty(pairs, H, dtype=torch.float32, device=x.device)
    route_w = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _launch(
        inter,
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
    """bf16 and fp32 activations: the dense GEMM and the two expert GEMMs at decode and prefill
    tiles (fp32 at its own, narrower tiles); on the dot_scaled targets (NATIVE_ARCHS) the bf16
    ones also with that path (",native"), the decode path staying compiled as their fall-back."""
    variants = []
    for dtype, elem in (("bf16", 2), ("fp32", 4)):
        types = {
            "a_ptr": f"*{dtype}",
            "w_ptr": "*u8",
            "w_s_ptr": "*u8",
            "out_ptr": f"*{dtype}",
            "route_w_ptr": "*fp32",
            "rows_ptr": "*i32",
            "block_expert_ptr": "*i32",
            "num_rows": "i32",
            "N": "i32",
            "K": "i32",
            "swiglu_limit": "fp32",
            "stride_a": "i32",
            "stride_we": "i64",
            "stride_wn": "i32",
            "stride_wse": "i32",
            "stride_wsn": "i32",
            "stride_o": "i32",
        }
        for rows, label in ((8, "decode"), (4096, "prefill")):
            bm, bn, warps = fp4_blocks(rows, elem_size=elem)
            shapes = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, GROUP=GROUP, UPCAST=False)
            gated_n = fp4_blocks(rows, gated=True, elem_size=elem)[1]
            paths = (False, True) if fp4_native(arch, torch.bfloat16) and dtype == "bf16" else (False,)
            for (kind, extra, out), native in itertools.product(
                (
                    ("dense", dict(A_DIV=1, DENSE=True, GATED=False, HAS_LIMIT=False, ROUTE_W=False), f"*{dtype}"),
                    ("moe_gate_up", dict(A_DIV=8, DENSE=False, GATED=True, HAS_LIMIT=True, ROUTE_W=False), f"*{dtype}"),
                    ("moe_down", dict(A_DIV=1, DENSE=False, GATED=False, HAS_LIMIT=False, ROUTE_W=True), "*fp32"),
                ),
                paths,
            ):
                variants.append(
                    KernelVariant(
                        name=f"fp4_gemm[{dtype},{kind},{label}{',native' if native else ''}]",
                        kernel=fp4_gemm_kernel,
                        types={**types, "out_ptr": out},
                        constexprs={
                            **extra,
                            **shapes,
                            **({"BLOCK_N": gated_n} if extra["GATED"] else {}),
                            "NATIVE": native,
                        },
                        num_warps=warps,
                        num_stages=3,
                        divisible=("N", "K"),
                    )
                )
    return variants
