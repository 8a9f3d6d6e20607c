"""DeepSeek-V4 compressor: gated softmax pooling of each window of projections into one entry,
then the entry's RMS norm, in one kernel.

A program takes one window and every column of the entry (the norm needs the whole row): it walks
the window's rows in BLOCK_R tiles with a per-column online softmax of gate + ape, so rows are
read once and no [windows, rows, width] softmax is materialised. With the overlap series (CSA) a
window also weighs the previous window's first series (columns :hd) besides its own second
series (hd:); the very first window of a sequence has no predecessor. Rope is the caller's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import KernelVariant, check_launchable, next_pow2


@triton.jit
def _pool_rows(kv_ptr, gate_ptr, ape_ptr, row0, col0, rate, stride_kv, stride_g, stride_a,
               m_i, l_i, acc, offs_d, d_mask, BLOCK_R: tl.constexpr):
    """Fold rows row0..row0+rate-1, columns col0.. of one series into the running softmax."""
    for r0 in range(0, rate, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_mask = r < rate
        mask = r_mask[:, None] & d_mask[None, :]
        rows = (row0 + r).to(tl.int64)
        g = tl.load(gate_ptr + rows[:, None] * stride_g + col0 + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        g += tl.load(ape_ptr + r[:, None] * stride_a + col0 + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.where(mask, g, float("-inf"))
        v = tl.load(kv_ptr + rows[:, None] * stride_kv + col0 + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
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
    kv_ptr, gate_ptr, ape_ptr, norm_ptr, out_ptr,
    rate, eps, has_prev,
    stride_kv, stride_g, stride_a, stride_o,
    HEAD_DIM: tl.constexpr, OVERLAP: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    k = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_i = tl.full([BLOCK_D], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_D], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    if OVERLAP:
        own = (k + has_prev) * rate
        if (k > 0) | (has_prev != 0):
            m_i, l_i, acc = _pool_rows(kv_ptr, gate_ptr, ape_ptr, own - rate, 0, rate, stride_kv, stride_g, stride_a,
                                       m_i, l_i, acc, offs_d, d_mask, BLOCK_R)
        m_i, l_i, acc = _pool_rows(kv_ptr, gate_ptr, ape_ptr, own, HEAD_DIM, rate, stride_kv, stride_g, stride_a,
                                   m_i, l_i, acc, offs_d, d_mask, BLOCK_R)
    else:
        m_i, l_i, acc = _pool_rows(kv_ptr, gate_ptr, ape_ptr, k * rate, 0, rate, stride_kv, stride_g, stride_a,
                                   m_i, l_i, acc, offs_d, d_mask, BLOCK_R)
    pooled = tl.where(d_mask, acc / tl.where(l_i > 0, l_i, 1.0), 0.0)
    inv = tl.rsqrt(tl.sum(pooled * pooled, 0) / HEAD_DIM + eps)
    w = tl.load(norm_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + k.to(tl.int64) * stride_o + offs_d, (w * pooled * inv).to(out_ptr.dtype.element_ty), mask=d_mask)


def _block_r(rate: int, block_d: int) -> int:
    # about 8k elements a tile: [16, 512] for the KV compressor, [64, 128] for the indexer's
    return max(1, min(next_pow2(rate), 8192 // block_d))


def v4_compress_pool(
    kv: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    num_windows: int,
    rate: int,
    overlap: bool,
    has_prev: bool,
    eps: float,
) -> torch.Tensor:
    check_launchable(v4_compress_pool_kernel, kv)
    width = kv.shape[1]
    hd = width // 2 if overlap else width
    out = torch.empty(num_windows, hd, dtype=kv.dtype, device=kv.device)
    if num_windows == 0:
        return out
    if kv.stride(-1) != 1 or gate.stride(-1) != 1:
        raise ValueError("v4_compress_pool needs the last dim of kv and gate contiguous")
    prev = 1 if (overlap and has_prev) else 0
    if kv.shape[0] < (num_windows + prev) * rate:
        raise ValueError(f"v4_compress_pool: {kv.shape[0]} rows for {num_windows} windows of {rate}")
    ape = ape.contiguous()
    block_d = next_pow2(hd)
    v4_compress_pool_kernel[(num_windows,)](
        kv, gate, ape, norm_weight.contiguous(), out,
        rate, eps, prev,
        kv.stride(0), gate.stride(0), ape.stride(0), out.stride(0),
        HEAD_DIM=hd, OVERLAP=bool(overlap), BLOCK_D=block_d, BLOCK_R=_block_r(rate, block_d),
        num_warps=4,
    )
    return out


def aot_variants(arch: int) -> list[KernelVariant]:
    """V4-Flash's compressors in bf16: CSA's KV (overlap, rate 4, 512) and indexer (rate 4, 128)
    and HCA's (rate 128, 512)."""
    variants = []
    for dtype, hd, overlap, rate, label in (("bf16", 512, True, 4, "csa"), ("bf16", 128, True, 4, "csa_index"),
                                            ("bf16", 512, False, 128, "hca"), ("fp32", 512, True, 4, "csa")):
        variants.append(KernelVariant(
            name=f"v4_compress_pool[{dtype},{label},d{hd}]",
            kernel=v4_compress_pool_kernel,
            types={
                "kv_ptr": f"*{dtype}", "gate_ptr": f"*{dtype}", "ape_ptr": "*fp32", "norm_ptr": "*fp32",
                "out_ptr": f"*{dtype}", "rate": "i32", "eps": "fp32", "has_prev": "i32",
                "stride_kv": "i32", "stride_g": "i32", "stride_a": "i32", "stride_o": "i32",
            },
            constexprs=dict(HEAD_DIM=hd, OVERLAP=overlap, BLOCK_D=next_pow2(hd), BLOCK_R=_block_r(rate, next_pow2(hd))),
            num_warps=4, num_stages=2,
        ))
    return variants
