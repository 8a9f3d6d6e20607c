"""Paged MLA decode attention, split-K over the sequence with a log-sum-exp merge.

All heads of a request read the same latent rows (MQA over the compressed cache), so a program
takes BLOCK_H heads of one request and one slice of its sequence: each KV tile is loaded once
for BLOCK_H heads. Head blocks are the fastest grid axis, so programs that share tiles run
together and hit L2. Every request's sequence is cut into ``num_splits`` slices (lengths
computed in the kernel from its own seq_len, so no host sync and no CUDA-graph hazard); a
second kernel merges the slices' partial outputs by their log-sum-exps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import (
    KernelVariant,
    fp32_twins,
    check_launchable,
    cuda_arch,
    next_pow2,
    note_occupancy,
    on_interpreter,
    programs_per_sm,
    small_shared,
    sm_count,
)

LOG2E = 1.4426950408889634
MAX_SPLITS = 64


@triton.jit
def mla_decode_split_kernel(
    q_ptr,
    kv_ptr,
    block_table_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    num_heads,
    num_splits,
    stride_q_b,
    stride_q_h,
    stride_kv_page,
    stride_kv_slot,
    stride_bt_b,
    stride_po_b,
    stride_po_h,
    stride_po_s,
    stride_pl_b,
    stride_pl_h,
    PAGE_SIZE: tl.constexpr,
    V_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr = False,
):
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_b = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + pid_b)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = pid_s * split_len
    end = tl.minimum(start + split_len, seq_len)

    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    offs_v = tl.arange(0, BLOCK_V)
    v_mask = offs_v < V_DIM
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < ROPE_DIM

    q_rows = q_ptr + pid_b * stride_q_b + heads[:, None] * stride_q_h
    q_lat = tl.load(q_rows + offs_v[None, :], mask=head_mask[:, None] & v_mask[None, :], other=0.0)
    q_rope = tl.load(q_rows + V_DIM + offs_r[None, :], mask=head_mask[:, None] & r_mask[None, :], other=0.0)
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_rope = q_rope.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    table = block_table_ptr + pid_b * stride_bt_b
    # Every tile starts before `end`, so each has a live key and m_i turns finite on the first.
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        page = tl.load(table + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        rows = kv_ptr + page * stride_kv_page + (offs_n % PAGE_SIZE) * stride_kv_slot
        if KV_FP8:
            # --kv-cache-dtype fp8_e4m3 (dsv4_engine.kv_quant): a row is V_DIM + ROPE_DIM e4m3
            # bytes then its float32 scale; load the bytes, view them as e4m3, scale in fp32
            k_lat = tl.load(rows[:, None] + offs_v[None, :], mask=n_mask[:, None] & v_mask[None, :], other=0)
            k_rope = tl.load(rows[:, None] + V_DIM + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0)
            kv_scale = tl.load((rows + V_DIM + ROPE_DIM).to(tl.pointer_type(tl.float32)), mask=n_mask, other=0.0)
            k_lat = (k_lat.to(tl.float8e4nv, bitcast=True).to(tl.float32) * kv_scale[:, None]).to(q_lat.dtype)
            k_rope = (k_rope.to(tl.float8e4nv, bitcast=True).to(tl.float32) * kv_scale[:, None]).to(q_rope.dtype)
        else:
            k_lat = tl.load(rows[:, None] + offs_v[None, :], mask=n_mask[:, None] & v_mask[None, :], other=0.0)
            k_rope = tl.load(rows[:, None] + V_DIM + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        if UPCAST:
            k_lat = k_lat.to(tl.float32)
            k_rope = k_rope.to(tl.float32)
        s = tl.dot(q_lat, tl.trans(k_lat), input_precision="ieee")
        s = tl.dot(q_rope, tl.trans(k_rope), s, input_precision="ieee")
        s = tl.where(n_mask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(k_lat.dtype), k_lat, acc, input_precision="ieee")
        m_i = m_new

    # An empty slice (short request, many splits) stores zeros and lse = -inf: weight 0 in the merge.
    live = l_i > 0.0
    l_safe = tl.where(live, l_i, 1.0)
    po = part_out_ptr + pid_b * stride_po_b + heads[:, None] * stride_po_h + pid_s * stride_po_s + offs_v[None, :]
    tl.store(po, acc / l_safe[:, None], mask=head_mask[:, None] & v_mask[None, :])
    lse = tl.where(live, m_i + tl.log2(l_safe), float("-inf"))
    tl.store(part_lse_ptr + pid_b * stride_pl_b + heads * stride_pl_h + pid_s, lse, mask=head_mask)


@triton.jit
def mla_decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    stride_po_b,
    stride_po_h,
    stride_po_s,
    stride_pl_b,
    stride_pl_h,
    stride_o_b,
    stride_o_h,
    V_DIM: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    head = tl.program_id(0)
    pid_b = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    lse_row = part_lse_ptr + pid_b * stride_pl_b + head * stride_pl_h
    lse = tl.load(lse_row + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # seq_len 0: every weight is 0, output 0
    denom = tl.sum(tl.exp2(lse - m), 0)

    offs_v = tl.arange(0, BLOCK_V)
    v_mask = offs_v < V_DIM
    acc = tl.zeros([BLOCK_V], tl.float32)
    po_row = part_out_ptr + pid_b * stride_po_b + head * stride_po_h
    for s in range(0, num_splits):
        w = tl.exp2(tl.load(lse_row + s) - m)
        acc += w * tl.load(po_row + s * stride_po_s + offs_v, mask=v_mask, other=0.0)
    out = tl.where(denom > 0.0, acc / tl.where(denom > 0.0, denom, 1.0), 0.0)
    tl.store(out_ptr + pid_b * stride_o_b + head * stride_o_h + offs_v, out.to(out_ptr.dtype.element_ty), mask=v_mask)


@dataclass(frozen=True)
class DecodeConfig:
    block_h: int = 16
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 2  # expected occupancy, for sizing the split count


def decode_config(v_dim: int, heads: int, arch: int | None, elem_size: int = 2) -> DecodeConfig:
    """Tiles for the split kernel, sized from AOT register/shared-memory reports.

    At the real latent width a [32, 512] bf16 KV tile is 32 KiB a stage. BLOCK_H 16 (4 warps,
    mma.sync, ~200 registers, two programs an SM) suits the usual 16 heads a GPU under tensor
    parallelism; 64 heads a program (8 warps) lets Hopper/Blackwell use wgmma/tcgen05 and reads
    each tile once for more heads, but needs ~210 KiB of shared memory on sm_100, which sm_120
    (~99 KiB) lacks: there 32 heads a program is the most. fp32 (the engine's exactness mode;
    its dots run on FMA units) takes 16-row tiles on 8 warps to stay in ~75 KiB, unspilled.
    """
    if next_pow2(v_dim) < 256:
        return DecodeConfig(block_h=16, block_n=64, num_warps=4, programs_per_sm=4)
    if elem_size > 2:
        return DecodeConfig(block_h=16, block_n=16, num_warps=8, programs_per_sm=2)
    if heads > 32 and not small_shared(arch):
        return DecodeConfig(block_h=64, block_n=32, num_warps=8, programs_per_sm=1)
    if heads > 16:
        return DecodeConfig(block_h=32, block_n=32, num_warps=8, programs_per_sm=2)
    return DecodeConfig(block_h=16, block_n=32, num_warps=4, programs_per_sm=2)


def default_num_splits(
    batch: int,
    head_blocks: int,
    max_len_bound: int,
    cfg: DecodeConfig,
    device: torch.device,
    resident: int | None = None,
) -> int:
    """Slices per request so that all (request, head block, slice) programs fit in one wave of
    resident programs: a second, partial wave would leave most of the GPU idle at the end.
    Never more slices than tiles in the longest possible sequence. `resident`: blocks an SM
    holds at once, measured from the compiled kernel (default: the config's guess)."""
    work = max(1, batch * head_blocks)
    slots = sm_count(device) * (resident or cfg.programs_per_sm)
    want = max(1, slots // work)
    return max(1, min(want, MAX_SPLITS, triton.cdiv(max_len_bound, cfg.block_n)))


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    v_dim: int,
    *,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    check_launchable(mla_decode_split_kernel, q)
    batch, heads, dim = q.shape
    page_size = kv_cache.shape[1]
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("mla_decode needs the last dim of q and kv_cache contiguous")
    kv_fp8 = kv_cache.dtype == torch.uint8  # packed FP8 entries with their scales (dsv4_engine.kv_quant)
    if kv_fp8 and kv_cache.shape[-1] != dim + 4:
        raise ValueError(f"mla_decode: FP8 kv_cache rows are {kv_cache.shape[-1]} bytes, not {dim} + 4")
    if q.dtype != kv_cache.dtype and not kv_fp8:
        raise ValueError(f"mla_decode: q is {q.dtype} but kv_cache is {kv_cache.dtype}")
    out = torch.empty(batch, heads, v_dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    cfg = config or decode_config(v_dim, heads, cuda_arch(q.device), q.element_size())
    head_blocks = triton.cdiv(heads, cfg.block_h)
    occupancy_key = ("mla_decode_split", cfg, q.dtype, dim, v_dim, q.device)
    if num_splits is None:
        num_splits = default_num_splits(
            batch,
            head_blocks,
            block_table.shape[1] * page_size,
            cfg,
            q.device,
            programs_per_sm(occupancy_key, cfg.programs_per_sm),
        )
    part_out = torch.empty(batch, heads, num_splits, v_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    # The engine passes int32 already; a no-op .to is still a dispatch on every layer.
    if seq_lens.dtype != torch.int32:
        seq_lens = seq_lens.to(torch.int32)
    if block_table.dtype != torch.int32:
        block_table = block_table.to(torch.int32)
    compiled = mla_decode_split_kernel[(head_blocks, num_splits, batch)](
        q,
        kv_cache,
        block_table,
        seq_lens,
        part_out,
        part_lse,
        sm_scale * LOG2E,
        heads,
        num_splits,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        block_table.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        PAGE_SIZE=page_size,
        V_DIM=v_dim,
        ROPE_DIM=dim - v_dim,
        BLOCK_H=cfg.block_h,
        BLOCK_N=cfg.block_n,
        BLOCK_V=next_pow2(v_dim),
        BLOCK_R=max(16, next_pow2(dim - v_dim)),
        UPCAST=on_interpreter(q),
        KV_FP8=kv_fp8,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    note_occupancy(occupancy_key, compiled, q.device, cfg.num_warps)
    mla_decode_merge_kernel[(heads, batch)](
        part_out,
        part_lse,
        out,
        num_splits,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        V_DIM=v_dim,
        BLOCK_V=next_pow2(v_dim),
        BLOCK_S=next_pow2(num_splits),
        num_warps=4 if v_dim >= 256 else 1,
    )
    return out


def aot_variants(arch: int) -> list[KernelVariant]:
    """The real latent width (512 + 64) in bf16 at 16 and 128 heads and in fp32, and the tiny
    test model's (64 + 16); the real width once more over an FP8 KV cache (--kv-cache-dtype
    fp8_e4m3: e4m3 rows and their scale, read as bytes)."""
    variants = []
    for dtype, v_dim, rope_dim, heads, fp8 in (
        ("bf16", 512, 64, 16, False),
        ("bf16", 512, 64, 128, False),
        ("bf16", 64, 16, 4, False),
        ("fp32", 512, 64, 16, False),
        ("bf16", 512, 64, 16, True),
    ):
        cfg = decode_config(v_dim, heads, arch, 4 if dtype == "fp32" else 2)
        variants.append(
            KernelVariant(
                name=f"mla_decode_split[{dtype},d{v_dim + rope_dim},h{heads}{',kv_fp8' if fp8 else ''}]",
                kernel=mla_decode_split_kernel,
                types={
                    "q_ptr": f"*{dtype}",
                    "kv_ptr": "*u8" if fp8 else f"*{dtype}",
                    "block_table_ptr": "*i32",
                    "seq_lens_ptr": "*i32",
                    "part_out_ptr": "*fp32",
                    "part_lse_ptr": "*fp32",
                    "qk_scale": "fp32",
                    "num_heads": "i32",
                    "num_splits": "i32",
                    **{
                        name: "i32"
                        for name in (
                            "stride_q_b",
                            "stride_q_h",
                            "stride_kv_page",
                            "stride_kv_slot",
                            "stride_bt_b",
                            "stride_po_b",
                            "stride_po_h",
                            "stride_po_s",
                            "stride_pl_b",
                            "stride_pl_h",
                        )
                    },
                },
                constexprs=dict(
                    PAGE_SIZE=64,
                    V_DIM=v_dim,
                    ROPE_DIM=rope_dim,
                    BLOCK_H=cfg.block_h,
                    BLOCK_N=cfg.block_n,
                    BLOCK_V=next_pow2(v_dim),
                    BLOCK_R=max(16, next_pow2(rope_dim)),
                    UPCAST=False,
                    KV_FP8=fp8,
                ),
                num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
            )
        )
    variants.append(
        KernelVariant(
            name="mla_decode_merge[bf16,v512]",
            kernel=mla_decode_merge_kernel,
            types={
                "part_out_ptr": "*fp32",
                "part_lse_ptr": "*fp32",
                "out_ptr": "*bf16",
                "num_splits": "i32",
                **{
                    name: "i32"
                    for name in (
                        "stride_po_b",
                        "stride_po_h",
                        "stride_po_s",
                        "stride_pl_b",
                        "stride_pl_h",
                        "stride_o_b",
                        "stride_o_h",
                    )
                },
            },
            constexprs=dict(V_DIM=512, BLOCK_V=512, BLOCK_S=16),
            num_warps=4,
            num_stages=1,
        )
    )
    return variants[:-1] + fp32_twins(variants[-1:])  # the merge: same tiles in either dtype
