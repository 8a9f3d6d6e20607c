"""DeepSeek-V4 compressor: gated softmax pooling of each window of projections into one entry,
then the entry's RMS norm, in one kernel.

A program takes one window and every column of the entry (the norm needs the whole row): it walks
the window's rows in BLOCK_R tiles with a per-column online softmax of gate + ape, so rows are
read once, in place (strided views of the stage ring or of a chunk's projections), and no
[windows, rows, width] softmax is materialised. With the overlap series (CSA) a window also
weighs the previous window's first series (columns :hd) besides its own second series (hd:);
window 0 has no predecessor. Rope is the caller's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import KernelVariant, check_launchable, next_pow2
from .common import fp32_twins


@triton.jit
def _pool_rows(
    kv_row,
    gate_row,
    ape_ptr,
    col0,
    rate,
    stride_kv_r,
    stride_g_r,
    stride_a,
    m_i,
    l_i,
    acc,
    offs_d,
    d_mask,
    BLOCK_R: tl.constexpr,
):
    """Fold rows 0..rate-1 (columns col0..) of one series into the running softmax."""
    for r0 in range(0, rate, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        mask = (r < rate)[:, None] & d_mask[None, :]
        g = tl.load(gate_row + r[:, None] * stride_g_r + col0 + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        g += tl.load(ape_ptr + r[:, None] * stride_a + col0 + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.where(mask, g, float("-inf"))
        v = tl.load(kv_row + r[:, None] * stride_kv_r + col0 + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        m_new = tl.maximum(m_i, tl.max(g, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # padded columns
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(g - m_use[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p * v, 0)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def v4_compress_pool_kernel(
    win_kv_ptr,
    win_gate_ptr,
    prev_kv_ptr,
    prev_gate_ptr,
    ape_ptr,
    norm_ptr,
    w_ids_ptr,
    out_ptr,
    rate,
    eps,
    stride_wk_n,
    stride_wk_r,
    stride_wg_n,
    stride_wg_r,
    stride_pk_n,
    stride_pk_r,
    stride_pg_n,
    stride_pg_r,
    stride_a,
    stride_o,
    HEAD_DIM: tl.constexpr,
    OVERLAP: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    k = tl.program_id(0)
    k64 = k.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_i = tl.full([BLOCK_D], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_D], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    own_kv = win_kv_ptr + k64 * stride_wk_n
    own_gate = win_gate_ptr + k64 * stride_wg_n
    if OVERLAP:
        if tl.load(w_ids_ptr + k) > 0:
            m_i, l_i, acc = _pool_rows(
                prev_kv_ptr + k64 * stride_pk_n,
                prev_gate_ptr + k64 * stride_pg_n,
                ape_ptr,
                0,
                rate,
                stride_pk_r,
                stride_pg_r,
                stride_a,
                m_i,
                l_i,
                acc,
                offs_d,
                d_mask,
                BLOCK_R,
            )
        m_i, l_i, acc = _pool_rows(
            own_kv,
            own_gate,
            ape_ptr,
            HEAD_DIM,
            rate,
            stride_wk_r,
            stride_wg_r,
            stride_a,
            m_i,
            l_i,
            acc,
            offs_d,
            d_mask,
            BLOCK_R,
        )
    else:
        m_i, l_i, acc = _pool_rows(
            own_kv,
            own_gate,
            ape_ptr,
            0,
            rate,
            stride_wk_r,
            stride_wg_r,
            stride_a,
            m_i,
            l_i,
            acc,
            offs_d,
            d_mask,
            BLOCK_R,
        )
    pooled = tl.where(d_mask, acc / tl.where(l_i > 0, l_i, 1.0), 0.0)
    inv = tl.rsqrt(tl.sum(pooled * pooled, 0) / HEAD_DIM + eps)
    w = tl.load(norm_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + k64 * stride_o + offs_d, (w * pooled * inv).to(out_ptr.dtype.element_ty), mask=d_mask)


def _block_r(rate: int, block_d: int) -> int:
    # about 8k elements a tile: [16, 512] for the KV compressor, [64, 128] for the indexer's
    return max(1, min(next_pow2(rate), 8192 // block_d))


def v4_compress_pool(
    win_kv: torch.Tensor,
    win_gate: torch.Tensor,
    prev_kv: torch.Tensor | None,
    prev_gate: torch.Tensor | None,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    w_ids: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    check_launchable(v4_compress_pool_kernel, win_kv)
    N, rate, width = win_kv.shape
    overlap = prev_kv is not None
    hd = width // 2 if overlap else width
    out = torch.empty(N, hd, dtype=win_kv.dtype, device=win_kv.device)
    if N == 0:
        return out
    pk, pg = (prev_kv, prev_gate) if overlap else (win_kv, win_gate)
    for name, x in (("win_kv", win_kv), ("win_gate", win_gate), ("prev_kv", pk), ("prev_gate", pg)):
        if x.stride(-1) != 1:
            raise ValueError(f"v4_compress_pool needs the last dim of {name} contiguous")
    ape = ape.float().contiguous()
    block_d = next_pow2(hd)
    v4_compress_pool_kernel[(N,)](
        win_kv,
        win_gate,
        pk,
        pg,
        ape,
        norm_weight.float().contiguous(),
        w_ids.to(torch.int32).contiguous(),
        out,
        rate,
        eps,
        win_kv.stride(0),
        win_kv.stride(1),
        win_gate.stride(0),
        win_gate.stride(1),
        pk.stride(0),
        pk.stride(1),
        pg.stride(0),
        pg.stride(1),
        ape.stride(0),
        out.stride(0),
        HEAD_DIM=hd,
        OVERLAP=overlap,
        BLOCK_D=block_d,
        BLOCK_R=_block_r(rate, block_d),
        num_warps=4,
    )
    return out


def aot_variants(arch: int) -> list[KernelVariant]:
    """V4-Flash's compressors: CSA's KV (overlap, rate 4, 512) and indexer (rate 4, 128) and
    HCA's (rate 128, 512), in bf16; CSA's in fp32."""
    variants = []
    for dtype, hd, overlap, rate, label in (
        ("bf16", 512, True, 4, "csa"),
        ("bf16", 128, True, 4, "csa_index"),
        ("bf16", 512, False, 128, "hca"),
        ("fp32", 512, True, 4, "csa"),
    ):
        variants.append(
            KernelVariant(
                name=f"v4_compress_pool[{dtype},{label},d{hd}]",
                kernel=v4_compress_pool_kernel,
                types={
                    "win_kv_ptr": f"*{dtype}",
                    "win_gate_ptr": f"*{dtype}",
                    "prev_kv_ptr": f"*{dtype}",
                    "prev_gate_ptr": f"*{dtype}",
                    "ape_ptr": "*fp32",
                    "norm_ptr": "*fp32",
                    "w_ids_ptr": "*i32",
                    "out_ptr": f"*{dtype}",
                    "rate": "i32",
                    "eps": "fp32",
                    **{
                        n: "i32"
                        for n in (
                            "stride_wk_n",
                            "stride_wk_r",
                            "stride_wg_n",
                            "stride_wg_r",
                            "stride_pk_n",
                            "stride_pk_r",
                            "stride_pg_n",
                            "stride_pg_r",
                            "stride_a",
                            "stride_o",
                        )
                    },
                },
                constexprs=dict(
                    HEAD_DIM=hd, OVERLAP=overlap, BLOCK_D=next_pow2(hd), BLOCK_R=_block_r(rate, next_pow2(hd))
                ),
                num_warps=4,
                num_stages=2,
            )
        )
    return fp32_twins(variants)
