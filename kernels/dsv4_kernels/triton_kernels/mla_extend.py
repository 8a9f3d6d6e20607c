"""Paged MLA extend (chunked prefill) attention: flash attention with a causal mask over each
request's whole cached sequence, whose new tokens' keys are already in the cache.

All heads share the latent keys, so the (token, head) pairs of one request are flattened into
rows and a program takes BLOCK_M of them: heads need not be a power of two, and each KV tile
serves several tokens and heads at once. A program walks the keys only up to its last row's
position (causality).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import KernelVariant, check_launchable, cuda_arch, next_pow2, on_interpreter, small_shared

LOG2E = 1.4426950408889634


@triton.jit
def mla_extend_kernel(
    q_ptr,
    kv_ptr,
    block_table_ptr,
    seq_lens_ptr,
    extend_lens_ptr,
    q_start_ptr,
    out_ptr,
    qk_scale,
    num_heads,
    stride_q_t,
    stride_q_h,
    stride_kv_page,
    stride_kv_slot,
    stride_bt_b,
    stride_o_t,
    stride_o_h,
    PAGE_SIZE: tl.constexpr,
    V_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_b = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + pid_b)
    ext = tl.load(extend_lens_ptr + pid_b)
    q_start = tl.load(q_start_ptr + pid_b)
    prefix = seq_len - ext
    n_rows = ext * num_heads

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    tok = rows // num_heads
    head = rows % num_heads
    pos = prefix + tok  # absolute position; attends to keys 0..pos
    # Keys this block needs: up to its last live row's position; none when the block is past
    # the request's rows (the grid covers the longest request).
    last_tok = (tl.minimum(pid_m * BLOCK_M + BLOCK_M, n_rows) - 1) // num_heads
    kv_end = tl.where(pid_m * BLOCK_M < n_rows, tl.minimum(seq_len, prefix + last_tok + 1), 0)

    offs_v = tl.arange(0, BLOCK_V)
    v_mask = offs_v < V_DIM
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < ROPE_DIM
    q_rows = q_ptr + (q_start + tok)[:, None].to(tl.int64) * stride_q_t + head[:, None] * stride_q_h
    q_lat = tl.load(q_rows + offs_v[None, :], mask=row_mask[:, None] & v_mask[None, :], other=0.0)
    q_rope = tl.load(q_rows + V_DIM + offs_r[None, :], mask=row_mask[:, None] & r_mask[None, :], other=0.0)
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_rope = q_rope.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    table = block_table_ptr + pid_b * stride_bt_b
    # Key 0 is in every row's past, so the first tile makes m_i finite; later all-future tiles
    # give p = 0 and leave it.
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        page = tl.load(table + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_rows = kv_ptr + page * stride_kv_page + (offs_n % PAGE_SIZE) * stride_kv_slot
        k_lat = tl.load(kv_rows[:, None] + offs_v[None, :], mask=n_mask[:, None] & v_mask[None, :], other=0.0)
        k_rope = tl.load(kv_rows[:, None] + V_DIM + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        if UPCAST:
            k_lat = k_lat.to(tl.float32)
            k_rope = k_rope.to(tl.float32)
        s = tl.dot(q_lat, tl.trans(k_lat), input_precision="ieee")
        s = tl.dot(q_rope, tl.trans(k_rope), s, input_precision="ieee")
        visible = n_mask[None, :] & (offs_n[None, :] <= pos[:, None])
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(k_lat.dtype), k_lat, acc, input_precision="ieee")
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_rows = out_ptr + (q_start + tok)[:, None].to(tl.int64) * stride_o_t + head[:, None] * stride_o_h
    tl.store(o_rows + offs_v[None, :], out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & v_mask[None, :])


@dataclass(frozen=True)
class ExtendConfig:
    block_m: int = 64
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 2


def extend_config(v_dim: int, arch: int | None, elem_size: int = 2) -> ExtendConfig:
    """A [64, 512] fp32 accumulator is 128 registers a thread at 8 warps (wgmma/tcgen05 on
    sm_90/sm_100). sm_120 has no wgmma and ~99 KiB of shared memory: 32 rows, 32 keys a tile,
    8 warps compiles without spills there. fp32 (FMA dots) takes 16 x 16 tiles on 8 warps."""
    if next_pow2(v_dim) >= 256:
        if elem_size > 2:
            return ExtendConfig(block_m=16, block_n=16, num_warps=8)
        if small_shared(arch):
            return ExtendConfig(block_m=32, block_n=32, num_warps=8)
        return ExtendConfig(block_m=64, block_n=32, num_warps=8)
    return ExtendConfig(block_m=64, block_n=64, num_warps=4)


def mla_extend(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    sm_scale: float,
    v_dim: int,
    *,
    max_extend_len: int | None = None,
    config: ExtendConfig | None = None,
) -> torch.Tensor:
    check_launchable(mla_extend_kernel, q)
    total, heads, dim = q.shape
    page_size = kv_cache.shape[1]
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("mla_extend needs the last dim of q and kv_cache contiguous")
    if q.dtype != kv_cache.dtype:
        raise ValueError(f"mla_extend: q is {q.dtype} but kv_cache is {kv_cache.dtype}")
    out = torch.empty(total, heads, v_dim, dtype=q.dtype, device=q.device)
    batch = extend_lens.shape[0]
    if total == 0 or batch == 0:
        return out
    cfg = config or extend_config(v_dim, cuda_arch(q.device), q.element_size())
    extend_lens = extend_lens.to(device=q.device, dtype=torch.int32)
    seq_lens = seq_lens.to(device=q.device, dtype=torch.int32)
    block_table = block_table.to(torch.int32)
    q_start = (torch.cumsum(extend_lens, 0, dtype=torch.int32) - extend_lens).contiguous()
    if max_extend_len is None:  # one host sync per prefill batch
        max_extend_len, covered = torch.stack([extend_lens.max(), extend_lens.sum()]).tolist()
        if covered != total:
            raise ValueError(f"sum(extend_lens)={covered} does not match q.shape[0]={total}")
    grid = (triton.cdiv(max_extend_len * heads, cfg.block_m), batch)
    mla_extend_kernel[grid](
        q,
        kv_cache,
        block_table,
        seq_lens,
        extend_lens,
        q_start,
        out,
        sm_scale * LOG2E,
        heads,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        PAGE_SIZE=page_size,
        V_DIM=v_dim,
        ROPE_DIM=dim - v_dim,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_V=next_pow2(v_dim),
        BLOCK_R=max(16, next_pow2(dim - v_dim)),
        UPCAST=on_interpreter(q),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def aot_variants(arch: int) -> list[KernelVariant]:
    """The real latent width (512 + 64), in bf16 and fp32."""
    variants = []
    for dtype in ("bf16", "fp32"):
        cfg = extend_config(512, arch, 4 if dtype == "fp32" else 2)
        variants.append(
            KernelVariant(
                name=f"mla_extend[{dtype},d576]",
                kernel=mla_extend_kernel,
                types={
                    "q_ptr": f"*{dtype}",
                    "kv_ptr": f"*{dtype}",
                    "block_table_ptr": "*i32",
                    "seq_lens_ptr": "*i32",
                    "extend_lens_ptr": "*i32",
                    "q_start_ptr": "*i32",
                    "out_ptr": f"*{dtype}",
                    "qk_scale": "fp32",
                    "num_heads": "i32",
                    **{
                        name: "i32"
                        for name in (
                            "stride_q_t",
                            "stride_q_h",
                            "stride_kv_page",
                            "stride_kv_slot",
                            "stride_bt_b",
                            "stride_o_t",
                            "stride_o_h",
                        )
                    },
                },
                constexprs=dict(
                    PAGE_SIZE=64,
                    V_DIM=512,
                    ROPE_DIM=64,
                    BLOCK_M=cfg.block_m,
                    BLOCK_N=cfg.block_n,
                    BLOCK_V=512,
                    BLOCK_R=64,
                    UPCAST=False,
                ),
                num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
            )
        )
    return variants
