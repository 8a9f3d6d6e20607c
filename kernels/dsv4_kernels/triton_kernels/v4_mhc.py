"""DeepSeek-V4 mHC (manifold-constrained hyper-connections) around each sublayer, fused.

``v4_hc_pre``: one program per few tokens reads their hc residual streams once to get the RMS factor
and the (2 + hc) * hc mixing logits (one pass over x against fn), turns them into pre/post
weights and the Sinkhorn-normalised hc x hc mixing matrix in registers (the torch version is
~45 tiny launches a call, twice a layer), then reads x a second time to write the collapsed
sublayer input. ``v4_hc_post`` writes the new streams post_k * out + sum_j comb[j, k] x_j in
one pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import KernelVariant, check_grid, check_launchable, next_pow2, on_interpreter, sm_count
from .common import fp32_twins


@triton.jit
def _mix_weights(
    a_pre, a_post, a_comb, sq, flat, base_ptr, scale_ptr, rms_eps, hc_eps, sinkhorn_iters, HC: tl.constexpr,
    BLOCK_HC: tl.constexpr,
):  # fmt: skip
    """(pre, post, comb) of a block of tokens from their mixing logits and sums of squares."""
    i = tl.arange(0, BLOCK_HC)
    i_mask = i < HC
    ij_mask = i_mask[:, None] & i_mask[None, :]
    comb_rows = 2 * HC + i[:, None] * HC + i[None, :]
    inv = tl.rsqrt(sq / flat + rms_eps)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    pre = tl.sigmoid(a_pre * inv[:, None] * s0 + tl.load(base_ptr + i, mask=i_mask, other=0.0)[None, :]) + hc_eps
    post = 2.0 * tl.sigmoid(a_post * inv[:, None] * s1 + tl.load(base_ptr + HC + i, mask=i_mask, other=0.0)[None, :])
    logit = a_comb * inv[:, None, None] * s2 + tl.load(base_ptr + comb_rows, mask=ij_mask, other=0.0)[None, :, :]
    logit = tl.where(ij_mask[None, :, :], logit, float("-inf"))
    row_max = tl.max(logit, 2)
    e = tl.exp(logit - tl.where(row_max == float("-inf"), 0.0, row_max)[:, :, None])  # padded rows: all -inf
    row_sum = tl.sum(e, 2)
    comb = tl.where(ij_mask[None, :, :], e / tl.where(row_sum > 0, row_sum, 1.0)[:, :, None] + hc_eps, 0.0)
    comb = comb / (tl.sum(comb, 1)[:, None, :] + hc_eps)
    for _ in range(1, sinkhorn_iters):
        comb = comb / (tl.sum(comb, 2)[:, :, None] + hc_eps)
        comb = comb / (tl.sum(comb, 1)[:, None, :] + hc_eps)
    return pre, post, comb


@triton.jit
def _mix_logits(
    x_ptr, fn_ptr, t64, t_mask, k_begin, k_end, stride_x_t, stride_fn, HC: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_HC: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Sums of squares and the three groups of mixing logits (rows of fn: pre, post, comb) of a
    block of tokens over flat columns [k_begin, k_end) of their streams."""
    i = tl.arange(0, BLOCK_HC)
    i_mask = i < HC
    ij_mask = i_mask[:, None] & i_mask[None, :]
    comb_rows = 2 * HC + i[:, None] * HC + i[None, :]
    sq = tl.zeros([BLOCK_T], tl.float32)
    a_pre = tl.zeros([BLOCK_T, BLOCK_HC], tl.float32)
    a_post = tl.zeros([BLOCK_T, BLOCK_HC], tl.float32)
    a_comb = tl.zeros([BLOCK_T, BLOCK_HC, BLOCK_HC], tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < k_end
        xv = tl.load(
            x_ptr + t64[:, None] * stride_x_t + k[None, :], mask=t_mask[:, None] & k_mask[None, :], other=0.0
        ).to(tl.float32)  # [T, K]
        sq += tl.sum(xv * xv, 1)
        m2 = i_mask[:, None] & k_mask[None, :]
        f_pre = tl.load(fn_ptr + i[:, None] * stride_fn + k[None, :], mask=m2, other=0.0)
        f_post = tl.load(fn_ptr + (HC + i)[:, None] * stride_fn + k[None, :], mask=m2, other=0.0)
        f_comb = tl.load(
            fn_ptr + comb_rows[:, :, None] * stride_fn + k[None, None, :],
            mask=ij_mask[:, :, None] & k_mask[None, None, :],
            other=0.0,
        )
        a_pre += tl.sum(f_pre[None, :, :] * xv[:, None, :], 2)
        a_post += tl.sum(f_post[None, :, :] * xv[:, None, :], 2)
        a_comb += tl.sum(f_comb[None, :, :, :] * xv[:, None, None, :], 3)
    return sq, a_pre, a_post, a_comb


@triton.jit
def _store_mix(post_ptr, comb_ptr, t64, t_mask, post, comb, stride_p_t, stride_c_t, HC: tl.constexpr,
               BLOCK_HC: tl.constexpr):  # fmt: skip
    i = tl.arange(0, BLOCK_HC)
    i_mask = i < HC
    ij_mask = i_mask[:, None] & i_mask[None, :]
    tl.store(post_ptr + t64[:, None] * stride_p_t + i[None, :], post, mask=t_mask[:, None] & i_mask[None, :])
    tl.store(
        comb_ptr + t64[:, None, None] * stride_c_t + (i[:, None] * HC + i[None, :])[None, :, :],
        comb,
        mask=t_mask[:, None, None] & ij_mask[None, :, :],
    )


@triton.jit
def _collapse(x_ptr, collapsed_ptr, t64, t_mask, pre, d_begin, d_end, dim, stride_x_t, stride_o_t,
              BLOCK_HC: tl.constexpr, HC: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """The collapsed input sum_j pre_j x_j of a block of tokens, columns [d_begin, d_end)."""
    i = tl.arange(0, BLOCK_HC)
    i_mask = i < HC
    for d0 in range(d_begin, d_end, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_mask = d < dim
        xs = tl.load(
            x_ptr + t64[:, None, None] * stride_x_t + i[None, :, None] * dim + d[None, None, :],
            mask=t_mask[:, None, None] & i_mask[None, :, None] & d_mask[None, None, :],
            other=0.0,
        )
        col = tl.sum(xs.to(tl.float32) * pre[:, :, None], 1)
        tl.store(
            collapsed_ptr + t64[:, None] * stride_o_t + d[None, :],
            col.to(collapsed_ptr.dtype.element_ty),
            mask=t_mask[:, None] & d_mask[None, :],
        )


@triton.jit
def v4_hc_pre_kernel(
    x_ptr,
    fn_ptr,
    base_ptr,
    scale_ptr,
    post_ptr,
    comb_ptr,
    collapsed_ptr,
    num_tokens,
    dim,
    rms_eps,
    hc_eps,
    sinkhorn_iters,
    stride_x_t,
    stride_fn,
    stride_p_t,
    stride_c_t,
    stride_o_t,
    HC: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HC: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Everything for a block of tokens in one program (batches that fill the device)."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = tok < num_tokens
    t64 = tok.to(tl.int64)
    flat = HC * dim
    sq, a_pre, a_post, a_comb = _mix_logits(
        x_ptr, fn_ptr, t64, t_mask, 0, flat, stride_x_t, stride_fn, HC, BLOCK_T, BLOCK_HC, BLOCK_K
    )
    pre, post, comb = _mix_weights(
        a_pre, a_post, a_comb, sq, flat, base_ptr, scale_ptr, rms_eps, hc_eps, sinkhorn_iters, HC, BLOCK_HC
    )
    _store_mix(post_ptr, comb_ptr, t64, t_mask, post, comb, stride_p_t, stride_c_t, HC, BLOCK_HC)
    _collapse(x_ptr, collapsed_ptr, t64, t_mask, pre, 0, dim, dim, stride_x_t, stride_o_t, BLOCK_HC, HC, BLOCK_D)


@triton.jit
def v4_hc_pre_partial_kernel(
    x_ptr,
    fn_ptr,
    part_ptr,
    num_tokens,
    dim,
    split_len,
    stride_x_t,
    stride_fn,
    stride_part_s,
    HC: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HC: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Small batches: program (token block, s) reduces flat columns [s * split_len, (s + 1) *
    split_len) and writes its partial sums: part[s, t] = (sum of squares, pre, post, comb
    logits), 1 + (2 + HC) * HC floats a token."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    s = tl.program_id(1)
    t_mask = tok < num_tokens
    t64 = tok.to(tl.int64)
    k_begin = s * split_len
    k_end = tl.minimum(k_begin + split_len, HC * dim)
    sq, a_pre, a_post, a_comb = _mix_logits(
        x_ptr, fn_ptr, t64, t_mask, k_begin, k_end, stride_x_t, stride_fn, HC, BLOCK_T, BLOCK_HC, BLOCK_K
    )
    i = tl.arange(0, BLOCK_HC)
    i_mask = i < HC
    ij_mask = i_mask[:, None] & i_mask[None, :]
    NP: tl.constexpr = 1 + (2 + HC) * HC
    row = part_ptr + s.to(tl.int64) * stride_part_s + t64 * NP
    tl.store(row, sq, mask=t_mask)
    tl.store(row[:, None] + 1 + i[None, :], a_pre, mask=t_mask[:, None] & i_mask[None, :])
    tl.store(row[:, None] + 1 + HC + i[None, :], a_post, mask=t_mask[:, None] & i_mask[None, :])
    tl.store(
        row[:, None, None] + 1 + 2 * HC + (i[:, None] * HC + i[None, :])[None, :, :],
        a_comb,
        mask=t_mask[:, None, None] & ij_mask[None, :, :],
    )


@triton.jit
def v4_hc_pre_finish_kernel(
    x_ptr,
    part_ptr,
    base_ptr,
    scale_ptr,
    post_ptr,
    comb_ptr,
    collapsed_ptr,
    num_tokens,
    dim,
    num_splits,
    rms_eps,
    hc_eps,
    sinkhorn_iters,
    stride_x_t,
    stride_part_s,
    stride_p_t,
    stride_c_t,
    stride_o_t,
    HC: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HC: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (token block, d block) sums the splits' partials in split order (deterministic),
    computes the weights (a few hundred flops: every d block recomputes them rather than wait
    for one) and writes its BLOCK_D columns of the collapsed input; d block 0 writes post/comb."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    pid_d = tl.program_id(1)
    t_mask = tok < num_tokens
    t64 = tok.to(tl.int64)
    i = tl.arange(0, BLOCK_HC)
    i_mask = i < HC
    ij_mask = i_mask[:, None] & i_mask[None, :]
    NP: tl.constexpr = 1 + (2 + HC) * HC
    sq = tl.zeros([BLOCK_T], tl.float32)
    a_pre = tl.zeros([BLOCK_T, BLOCK_HC], tl.float32)
    a_post = tl.zeros([BLOCK_T, BLOCK_HC], tl.float32)
    a_comb = tl.zeros([BLOCK_T, BLOCK_HC, BLOCK_HC], tl.float32)
    for s in range(0, num_splits):
        row = part_ptr + s * stride_part_s + t64 * NP
        sq += tl.load(row, mask=t_mask, other=0.0)
        a_pre += tl.load(row[:, None] + 1 + i[None, :], mask=t_mask[:, None] & i_mask[None, :], other=0.0)
        a_post += tl.load(row[:, None] + 1 + HC + i[None, :], mask=t_mask[:, None] & i_mask[None, :], other=0.0)
        a_comb += tl.load(
            row[:, None, None] + 1 + 2 * HC + (i[:, None] * HC + i[None, :])[None, :, :],
            mask=t_mask[:, None, None] & ij_mask[None, :, :],
            other=0.0,
        )
    pre, post, comb = _mix_weights(
        a_pre, a_post, a_comb, sq, HC * dim, base_ptr, scale_ptr, rms_eps, hc_eps, sinkhorn_iters, HC, BLOCK_HC
    )
    if pid_d == 0:
        _store_mix(post_ptr, comb_ptr, t64, t_mask, post, comb, stride_p_t, stride_c_t, HC, BLOCK_HC)
    d_begin = pid_d * BLOCK_D
    _collapse(
        x_ptr, collapsed_ptr, t64, t_mask, pre, d_begin, d_begin + BLOCK_D, dim, stride_x_t, stride_o_t, BLOCK_HC, HC,
        BLOCK_D,
    )  # fmt: skip


@triton.jit
def v4_hc_post_kernel(
    x_ptr,
    out_ptr,
    post_ptr,
    comb_ptr,
    new_ptr,
    dim,
    stride_x_t,
    stride_o_t,
    stride_p_t,
    stride_c_t,
    stride_n_t,
    HC: tl.constexpr,
    BLOCK_HC: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < dim
    j = tl.arange(0, BLOCK_HC)
    j_mask = j < HC
    t64 = t.to(tl.int64)
    xs = tl.load(
        x_ptr + t64 * stride_x_t + j[:, None] * dim + d[None, :], mask=j_mask[:, None] & d_mask[None, :], other=0.0
    ).to(tl.float32)
    o = tl.load(out_ptr + t64 * stride_o_t + d, mask=d_mask, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t64 * stride_p_t + j, mask=j_mask, other=0.0)
    comb = tl.load(
        comb_ptr + t64 * stride_c_t + j[:, None] * HC + j[None, :], mask=j_mask[:, None] & j_mask[None, :], other=0.0
    )  # [j, k]
    mixed = tl.sum(comb[:, :, None] * xs[:, None, :], 0)  # [k, d]
    new = post[:, None] * o[None, :] + mixed
    tl.store(
        new_ptr + t64 * stride_n_t + j[:, None] * dim + d[None, :],
        new.to(new_ptr.dtype.element_ty),
        mask=j_mask[:, None] & d_mask[None, :],
    )


def hc_pre_tiles(interpreter: bool) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_K, BLOCK_D). A program takes several tokens: each reads fn (1.5 MiB at
    V4-Flash's width) once for all of them, and the Sinkhorn loop's tiny ops run once for the
    lot, which is what the interpreter pays for (per op, not per element)."""
    return (16, 256, 1024) if interpreter else (4, 64, 256)


def hc_pre_splits(token_blocks: int, flat: int, block_k: int, sms: int) -> tuple[int, int]:
    """(num_splits, split_len): how many programs share each token block's pass over its
    hc * dim columns, and the columns each takes (whole BLOCK_K tiles, at least 4 of them).
    One split (the fused kernel) once the token blocks fill half the device; at batch 1 on
    V4-Flash (16,384 columns) 64 programs instead of one. From shapes alone (graph-safe)."""
    if token_blocks * 2 >= sms:
        return 1, flat
    want = max(1, min(sms // max(1, token_blocks), triton.cdiv(flat, 4 * block_k)))
    split_len = triton.cdiv(triton.cdiv(flat, want), block_k) * block_k
    return triton.cdiv(flat, split_len), split_len


def v4_hc_pre(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    *,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """num_splits: programs per token block over the hc * dim columns (None: hc_pre_splits; the
    interpreter, where every program costs CPU time, takes the fused kernel)."""
    check_launchable(v4_hc_pre_kernel, x)
    T, hc, dim = x.shape
    x = x.contiguous()
    post = torch.empty(T, hc, dtype=torch.float32, device=x.device)
    comb = torch.empty(T, hc, hc, dtype=torch.float32, device=x.device)
    collapsed = torch.empty(T, dim, dtype=x.dtype, device=x.device)
    if T == 0:
        return post, comb, collapsed
    fn = fn.float().contiguous()
    base = base.float().contiguous()
    scale = scale.float().contiguous()
    block_t, block_k, block_d = hc_pre_tiles(on_interpreter(x))
    block_d = min(block_d, next_pow2(dim))
    token_blocks = triton.cdiv(T, block_t)
    flat = hc * dim
    if num_splits is None:
        splits, split_len = (
            (1, flat) if on_interpreter(x) else hc_pre_splits(token_blocks, flat, block_k, sm_count(x.device))
        )
    else:
        splits = max(1, int(num_splits))
        split_len = triton.cdiv(triton.cdiv(flat, splits), block_k) * block_k
        splits = triton.cdiv(flat, split_len)
    shapes = dict(HC=hc, BLOCK_T=block_t, BLOCK_HC=next_pow2(hc), num_warps=4)
    if splits == 1:
        v4_hc_pre_kernel[(token_blocks,)](
            x,
            fn,
            base,
            scale,
            post,
            comb,
            collapsed,
            T,
            dim,
            rms_eps,
            hc_eps,
            sinkhorn_iters,
            x.stride(0),
            fn.stride(0),
            post.stride(0),
            comb.stride(0),
            collapsed.stride(0),
            BLOCK_K=block_k,
            BLOCK_D=block_d,
            **shapes,
        )
        return post, comb, collapsed
    part = torch.empty(splits, T, 1 + (2 + hc) * hc, dtype=torch.float32, device=x.device)
    v4_hc_pre_partial_kernel[check_grid((token_blocks, splits))](
        x, fn, part, T, dim, split_len, x.stride(0), fn.stride(0), part.stride(0), BLOCK_K=block_k, **shapes
    )
    v4_hc_pre_finish_kernel[check_grid((token_blocks, triton.cdiv(dim, block_d)))](
        x,
        part,
        base,
        scale,
        post,
        comb,
        collapsed,
        T,
        dim,
        splits,
        rms_eps,
        hc_eps,
        sinkhorn_iters,
        x.stride(0),
        part.stride(0),
        post.stride(0),
        comb.stride(0),
        collapsed.stride(0),
        BLOCK_D=block_d,
        **shapes,
    )
    return post, comb, collapsed


def v4_hc_post(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    check_launchable(v4_hc_post_kernel, x)
    T, hc, dim = x.shape
    x = x.contiguous()
    out = out.contiguous()
    new = torch.empty_like(x)
    if T == 0:
        return new
    post = post.float().contiguous()
    comb = comb.float().contiguous()
    block_d = min(512, next_pow2(dim))
    v4_hc_post_kernel[(T, triton.cdiv(dim, block_d))](
        x,
        out,
        post,
        comb,
        new,
        dim,
        x.stride(0),
        out.stride(0),
        post.stride(0),
        comb.stride(0),
        new.stride(0),
        HC=hc,
        BLOCK_HC=next_pow2(hc),
        BLOCK_D=block_d,
        num_warps=4,
    )
    return new


def aot_variants(arch: int) -> list[KernelVariant]:
    """V4-Flash's mHC: 4 streams of 4096, bf16 residuals."""
    return fp32_twins(
        [
            KernelVariant(
                name="v4_hc_pre[bf16,hc4]",
                kernel=v4_hc_pre_kernel,
                types={
                    "x_ptr": "*bf16",
                    "fn_ptr": "*fp32",
                    "base_ptr": "*fp32",
                    "scale_ptr": "*fp32",
                    "post_ptr": "*fp32",
                    "comb_ptr": "*fp32",
                    "collapsed_ptr": "*bf16",
                    "num_tokens": "i32",
                    "dim": "i32",
                    "rms_eps": "fp32",
                    "hc_eps": "fp32",
                    "sinkhorn_iters": "i32",
                    **{n: "i32" for n in ("stride_x_t", "stride_fn", "stride_p_t", "stride_c_t", "stride_o_t")},
                },
                constexprs=dict(
                    HC=4,
                    BLOCK_T=hc_pre_tiles(False)[0],
                    BLOCK_HC=4,
                    BLOCK_K=hc_pre_tiles(False)[1],
                    BLOCK_D=hc_pre_tiles(False)[2],
                ),
                divisible=("dim",),
                num_warps=4,
                num_stages=2,
            ),
            KernelVariant(
                name="v4_hc_pre_partial[bf16,hc4]",
                kernel=v4_hc_pre_partial_kernel,
                types={
                    "x_ptr": "*bf16",
                    "fn_ptr": "*fp32",
                    "part_ptr": "*fp32",
                    "num_tokens": "i32",
                    "dim": "i32",
                    "split_len": "i32",
                    **{n: "i32" for n in ("stride_x_t", "stride_fn", "stride_part_s")},
                },
                constexprs=dict(HC=4, BLOCK_T=hc_pre_tiles(False)[0], BLOCK_HC=4, BLOCK_K=hc_pre_tiles(False)[1]),
                divisible=("dim", "split_len"),
                num_warps=4,
                num_stages=2,
            ),
            KernelVariant(
                name="v4_hc_pre_finish[bf16,hc4]",
                kernel=v4_hc_pre_finish_kernel,
                types={
                    "x_ptr": "*bf16",
                    "part_ptr": "*fp32",
                    "base_ptr": "*fp32",
                    "scale_ptr": "*fp32",
                    "post_ptr": "*fp32",
                    "comb_ptr": "*fp32",
                    "collapsed_ptr": "*bf16",
                    "num_tokens": "i32",
                    "dim": "i32",
                    "num_splits": "i32",
                    "rms_eps": "fp32",
                    "hc_eps": "fp32",
                    "sinkhorn_iters": "i32",
                    **{n: "i32" for n in ("stride_x_t", "stride_part_s", "stride_p_t", "stride_c_t", "stride_o_t")},
                },
                constexprs=dict(HC=4, BLOCK_T=hc_pre_tiles(False)[0], BLOCK_HC=4, BLOCK_D=hc_pre_tiles(False)[2]),
                divisible=("dim",),
                num_warps=4,
                num_stages=1,
            ),
            KernelVariant(
                name="v4_hc_post[bf16,hc4]",
                kernel=v4_hc_post_kernel,
                types={
                    "x_ptr": "*bf16",
                    "out_ptr": "*bf16",
                    "post_ptr": "*fp32",
                    "comb_ptr": "*fp32",
                    "new_ptr": "*bf16",
                    "dim": "i32",
                    **{n: "i32" for n in ("stride_x_t", "stride_o_t", "stride_p_t", "stride_c_t", "stride_n_t")},
                },
                constexprs=dict(HC=4, BLOCK_HC=4, BLOCK_D=512),
                divisible=("dim",),
                num_warps=4,
                num_stages=1,
            ),
        ]
    )
