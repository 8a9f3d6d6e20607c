"""DeepSeek-V4 attention: shared-KV MQA (one kv head, K == V, head_dim 512 with the rope channels
inside) over a sliding window plus compressed entries, with a per-head attention sink.

One kernel serves decode and extend. A program takes BLOCK_H heads of ONE query token and one
slice of that token's key list, so each key tile is read once for BLOCK_H heads. The key list of
a query at position p (request b, chunk starting at position s) is virtual, walked in BLOCK_N
tiles without being gathered anywhere:
  [window: positions max(0, p-W+1) .. p — the ring row for positions < s, the chunk's own kv row
   otherwise] ++ [compressed: the CSA entries the indexer picked (comp_idx, -1 = none) or every
   HCA entry w < (p+1) // rate], each entry read in place from its page via the block table.
Decode splits the key list over ``num_splits`` programs (lengths computed in the kernel: no host
sync); a second kernel merges the slices by their log-sum-exps and adds the sink. Extend runs one
slice a token and writes the output, sink included, directly (a [T, H, splits, hd] fp32 partial
buffer for a long prefill would dwarf the KV it reads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import (
    KernelVariant,
    fp32_twins,
    check_grid,
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
def v4_attn_kernel(
    q_ptr,
    kv_ptr,
    ring_ptr,
    comp_ptr,
    block_table_ptr,
    comp_idx_ptr,
    sink_ptr,
    positions_ptr,
    token_req_ptr,
    req_row0_ptr,
    slot_ids_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    num_heads,
    num_splits,
    window,
    rate,
    page_size,
    entries_per_page,
    num_comp_idx,
    stride_q_t,
    stride_q_h,
    stride_kv_t,
    stride_ring_slot,
    stride_ring_w,
    stride_comp_page,
    stride_comp_e,
    stride_bt_b,
    stride_ci_t,
    stride_o_t,
    stride_o_h,
    stride_po_t,
    stride_po_h,
    stride_po_s,
    stride_pl_t,
    stride_pl_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_COMP: tl.constexpr,
    SPARSE: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr = False,
):
    # Tokens on axis 0: axes 1 and 2 of a CUDA grid stop at 65,535, axis 0 does not, so extend
    # steps of any length launch. (Decoding over (token, head block) in one axis cost 8 bytes
    # of spill on sm_90 for the div/mod; a decode grid is one wave, so the order is free.)
    t = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_h = tl.program_id(2)

    p = tl.load(positions_ptr + t).to(tl.int32)
    b = tl.load(token_req_ptr + t)
    row0 = tl.load(req_row0_ptr + b)
    s = p - (t - row0)  # position of the chunk's first token
    slot = tl.load(slot_ids_ptr + b).to(tl.int64)
    lo = tl.maximum(p - window + 1, 0)
    n_win = p - lo + 1
    if HAS_COMP:
        if SPARSE:
            n_comp = num_comp_idx
        else:
            n_comp = (p + 1) // rate
    else:
        n_comp = 0
    total = n_win + n_comp
    split_len = tl.cdiv(tl.cdiv(total, num_splits), BLOCK_N) * BLOCK_N
    k_start = pid_s * split_len
    k_end = tl.minimum(k_start + split_len, total)

    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + t.to(tl.int64) * stride_q_t + heads[:, None] * stride_q_h + offs_d[None, :],
        mask=head_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    ring_base = ring_ptr + slot * stride_ring_slot
    table = block_table_ptr + b.to(tl.int64) * stride_bt_b
    for n0 in range(k_start, k_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        live = n < k_end
        # window keys: position wp; earlier chunks' tokens from the ring, this chunk's from kv
        wp = lo + n
        in_win = n < n_win
        ring_row = ring_base + (wp % window).to(tl.int64) * stride_ring_w
        own_row = kv_ptr + (t - (p - wp)).to(tl.int64) * stride_kv_t
        if KV_FP8:
            rows = ring_row  # packed rows (the ring's, the entries' below); own rows load apart
        else:
            rows = tl.where(wp < s, ring_row, own_row)
        valid = live
        if HAS_COMP:
            k = n - n_win
            in_comp = live & (n >= n_win)
            if SPARSE:
                w = tl.load(comp_idx_ptr + t.to(tl.int64) * stride_ci_t + k, mask=in_comp, other=-1)
                in_comp = in_comp & (w >= 0)
                valid = (live & in_win) | in_comp
            else:
                w = k
            w = tl.maximum(w, 0)
            page = tl.load(table + (w * rate) // page_size, mask=in_comp, other=0).to(tl.int64)
            comp_row = comp_ptr + page * stride_comp_page + (w % entries_per_page).to(tl.int64) * stride_comp_e
            rows = tl.where(in_win, rows, comp_row)
        if KV_FP8:
            # --kv-cache-dtype fp8_e4m3 (dsv4_engine.kv_quant): a ring row or entry is HEAD_DIM
            # e4m3 bytes then its float32 scale, loaded as bytes, viewed as e4m3, scaled in fp32;
            # the chunk's own keys (not stored yet) come in q's dtype from kv
            own = valid & (n < n_win) & (wp >= s)
            packed = valid & ((n >= n_win) | (wp < s))
            raw = tl.load(rows[:, None] + offs_d[None, :], mask=packed[:, None] & d_mask[None, :], other=0)
            row_scale = tl.load((rows + HEAD_DIM).to(tl.pointer_type(tl.float32)), mask=packed, other=0.0)
            mine = tl.load(own_row[:, None] + offs_d[None, :], mask=own[:, None] & d_mask[None, :], other=0.0)
            keys = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * row_scale[:, None] + mine.to(tl.float32)
            keys = keys.to(q.dtype)
        else:
            keys = tl.load(rows[:, None] + offs_d[None, :], mask=valid[:, None] & d_mask[None, :], other=0.0)
        if UPCAST:
            keys = keys.to(tl.float32)
        sc = tl.dot(q, tl.trans(keys), input_precision="ieee")
        sc = tl.where(valid[None, :], sc * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        # a tile of only dropped CSA picks leaves m at -inf: keep the arithmetic finite
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        pr = tl.exp2(sc - m_use[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(pr.to(keys.dtype), keys, acc, input_precision="ieee")
        m_i = m_new

    if SPLIT:
        live_s = l_i > 0.0
        l_safe = tl.where(live_s, l_i, 1.0)
        po = (
            part_out_ptr
            + t.to(tl.int64) * stride_po_t
            + heads[:, None] * stride_po_h
            + pid_s * stride_po_s
            + offs_d[None, :]
        )
        tl.store(po, acc / l_safe[:, None], mask=head_mask[:, None] & d_mask[None, :])
        lse = tl.where(live_s, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + t.to(tl.int64) * stride_pl_t + heads * stride_pl_h + pid_s, lse, mask=head_mask)
    else:
        # the sink joins the softmax's denominator only
        sink = tl.load(sink_ptr + heads, mask=head_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_fin = tl.maximum(m_i, sink)
        denom = l_i * tl.exp2(m_i - m_fin) + tl.exp2(sink - m_fin)
        out = acc * (tl.exp2(m_i - m_fin) / denom)[:, None]
        tl.store(
            out_ptr + t.to(tl.int64) * stride_o_t + heads[:, None] * stride_o_h + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=head_mask[:, None] & d_mask[None, :],
        )


@triton.jit
def v4_attn_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    sink_ptr,
    out_ptr,
    num_splits,
    stride_po_t,
    stride_po_h,
    stride_po_s,
    stride_pl_t,
    stride_pl_h,
    stride_o_t,
    stride_o_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    t = tl.program_id(0)  # tokens on axis 0: more than 65,535 of them launch
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    lse_row = part_lse_ptr + t.to(tl.int64) * stride_pl_t + head * stride_pl_h
    lse = tl.load(lse_row + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    sink = tl.load(sink_ptr + head).to(tl.float32) * 1.4426950408889634
    m = tl.maximum(tl.max(lse, 0), sink)
    denom = tl.sum(tl.exp2(lse - m), 0) + tl.exp2(sink - m)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    acc = tl.zeros([BLOCK_D], tl.float32)
    po_row = part_out_ptr + t.to(tl.int64) * stride_po_t + head * stride_po_h
    for sp in range(0, num_splits):
        w = tl.exp2(tl.load(lse_row + sp) - m)
        acc += w * tl.load(po_row + sp * stride_po_s + offs_d, mask=d_mask, other=0.0)
    tl.store(
        out_ptr + t.to(tl.int64) * stride_o_t + head * stride_o_h + offs_d,
        (acc / denom).to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


@dataclass(frozen=True)
class AttnConfig:
    block_h: int = 16
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 2  # expected occupancy, for sizing the split count


# --kv-cache-dtype fp8_e4m3: the packed tile, its fp32 conversion and the chunk's own rows
# take registers. From the AOT reports at head_dim 512: 32 or 64 heads a program spill on
# sm_100/sm_120 (and extend on sm_90), 16 heads x 32 keys on 8 warps fits every target (a
# token's head tiles read the same keys, mostly from L2); fp32 (exactness mode) fits with one
# stage only (two: 1-3 KiB spill).
FP8_BF16 = AttnConfig(block_h=16, block_n=32, num_warps=8, programs_per_sm=2)
FP8_FP32 = AttnConfig(block_h=16, block_n=16, num_warps=8, num_stages=1, programs_per_sm=2)


def attn_config(head_dim: int, heads: int, arch: int | None, elem_size: int = 2, kv_fp8: bool = False) -> AttnConfig:
    """Tiles sized from the AOT register / shared-memory reports (scripts/compile_kernels.py).

    64 heads a program (8 warps, wgmma / tcgen05) reads each key tile once for all of
    V4-Flash's heads; its [64, 512] fp32 accumulator leaves room for 16-key tiles only (32
    spill on sm_90) and needs ~96 KiB of shared memory: Hopper and sm_100. sm_120 (~99 KiB)
    takes 32 heads a program with 32-key tiles. fp32 (exactness mode, FMA dots) takes
    16-row tiles on 8 warps. Narrow heads (tests, v4-tiny) take wide key tiles."""
    if next_pow2(head_dim) < 256:
        return AttnConfig(block_h=16, block_n=32, num_warps=4, programs_per_sm=4)
    if kv_fp8:
        return FP8_FP32 if elem_size > 2 else FP8_BF16
    if elem_size > 2:
        return AttnConfig(block_h=16, block_n=16, num_warps=8, programs_per_sm=2)
    if heads > 32 and not small_shared(arch):
        return AttnConfig(block_h=64, block_n=16, num_warps=8, programs_per_sm=1)
    if heads > 16:
        return AttnConfig(block_h=32, block_n=32, num_warps=8, programs_per_sm=2)
    return AttnConfig(block_h=16, block_n=32, num_warps=8, programs_per_sm=2)  # 4 warps spill on sm_120


def _occupancy_key(q, cfg, ring, comp_kv, comp_idx) -> tuple:
    fp8 = ring.dtype == torch.uint8
    return ("v4_attn", cfg, q.dtype, fp8, q.shape[-1], comp_kv is not None, comp_idx is not None, q.device)


def attn_grid(tokens: int, head_blocks: int, num_splits: int) -> tuple[int, int, int]:
    """(token, split, head block): tokens ride on axis 0, the only one past 65,535."""
    return check_grid((tokens, num_splits, head_blocks))


def merge_grid(tokens: int, heads: int) -> tuple[int, int]:
    return check_grid((tokens, heads))


def _check(q, kv, ring, comp_kv) -> bool:
    """Whether the ring and entries are packed FP8 rows (uint8, head_dim + 4 bytes:
    dsv4_engine.kv_quant's format); ValueError on mismatched dtypes or widths."""
    if any(x is not None and x.stride(-1) != 1 for x in (q, kv, ring, comp_kv)):
        raise ValueError("v4 attention needs the last dim of q, kv, ring and comp_kv contiguous")
    if kv.dtype != q.dtype:
        raise ValueError(f"v4 attention: q is {q.dtype} but kv is {kv.dtype}")
    fp8 = ring.dtype == torch.uint8
    for name, x in (("ring", ring), ("comp_kv", comp_kv)):
        if x is None:
            continue
        if fp8 and (x.dtype != torch.uint8 or x.shape[-1] != q.shape[-1] + 4):
            raise ValueError(
                f"v4 attention: FP8 {name} rows must be uint8 of {q.shape[-1]} + 4 bytes, not {x.dtype} x {x.shape[-1]}"
            )
        if not fp8 and x.dtype != q.dtype:
            raise ValueError(f"v4 attention: q is {q.dtype} but {name} is {x.dtype}")
    return fp8


def _launch(
    q,
    kv,
    ring,
    slot_ids,
    positions,
    token_req,
    req_row0,
    block_table,
    comp_kv,
    comp_idx,
    sink,
    sm_scale,
    rate,
    page_size,
    num_splits,
    cfg,
):
    T, H, hd = q.shape
    out = torch.empty_like(q)
    if T == 0:
        return out
    head_blocks = triton.cdiv(H, cfg.block_h)
    split = num_splits > 1
    if split:
        part_out = torch.empty(T, H, num_splits, hd, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(T, H, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(1, 1, 1, dtype=torch.float32, device=q.device)
    has_comp = comp_kv is not None
    sparse = has_comp and comp_idx is not None
    comp = comp_kv if has_comp else ring
    cidx = _i32(comp_idx, q) if sparse else slot_ids
    epp = comp.shape[1] if has_comp else 1
    sink = sink.to(device=q.device, dtype=torch.float32).contiguous()
    compiled = v4_attn_kernel[attn_grid(T, head_blocks, num_splits)](
        q,
        kv,
        ring,
        comp,
        block_table,
        cidx,
        sink,
        positions,
        token_req,
        req_row0,
        slot_ids,
        out,
        part_out,
        part_lse,
        sm_scale * LOG2E,
        H,
        num_splits,
        ring.shape[1],
        max(1, rate),
        page_size,
        epp,
        cidx.shape[1] if sparse else 0,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        ring.stride(0),
        ring.stride(1),
        comp.stride(0),
        comp.stride(1),
        block_table.stride(0),
        cidx.stride(0) if sparse else 0,
        out.stride(0),
        out.stride(1),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        HEAD_DIM=hd,
        BLOCK_H=cfg.block_h,
        BLOCK_N=cfg.block_n,
        BLOCK_D=next_pow2(hd),
        HAS_COMP=has_comp,
        SPARSE=sparse,
        SPLIT=split,
        UPCAST=on_interpreter(q),
        KV_FP8=ring.dtype == torch.uint8,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    note_occupancy(_occupancy_key(q, cfg, ring, comp_kv, comp_idx), compiled, q.device, cfg.num_warps)
    if split:
        v4_attn_merge_kernel[merge_grid(T, H)](
            part_out,
            part_lse,
            sink,
            out,
            num_splits,
            part_out.stride(0),
            part_out.stride(1),
            part_out.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=hd,
            BLOCK_D=next_pow2(hd),
            BLOCK_S=next_pow2(num_splits),
            num_warps=4 if hd >= 256 else 1,
        )
    return out


HEAD_TILE_STEPS = {
    64: AttnConfig(block_h=32, block_n=32, num_warps=8, programs_per_sm=2),
    32: AttnConfig(block_h=16, block_n=32, num_warps=8, programs_per_sm=2),
}


def decode_config(
    head_dim: int, heads: int, arch: int | None, elem_size: int, tokens: int, sms: int, kv_fp8: bool = False
) -> AttnConfig:
    """attn_config, with smaller head tiles while the grid would leave over half the SMs idle:
    the programs of one token's head tiles read the same keys (resident together in a decode's
    single wave, so mostly from L2), while a split of the key list costs HBM traffic: every split writes and the merge
    reads a [heads, hd] fp32 partial, as large as ~100 of the keys it saves at 64 heads (MQA:
    every head shares every key). Batch 64 x 64 heads on 132 SMs: 32 heads a program, no split."""
    cfg = attn_config(head_dim, heads, arch, elem_size, kv_fp8)
    while cfg.block_h in HEAD_TILE_STEPS and elem_size <= 2 and 2 * tokens * triton.cdiv(heads, cfg.block_h) < sms:
        cfg = HEAD_TILE_STEPS[cfg.block_h]
    return cfg


def default_num_splits(
    tokens: int, head_blocks: int, max_keys: int, cfg: AttnConfig, device: torch.device, resident: int | None = None
) -> int:
    """Slices of each key list: none once the grid fills a quarter of the resident programs
    (partials would cost more HBM traffic than the idle SMs save); else enough to fill one
    wave, with at least two key tiles a slice. `resident`: blocks an SM holds at once,
    measured from the compiled kernel (default: the config's guess)."""
    slots = sm_count(device) * (resident or cfg.programs_per_sm)
    work = max(1, tokens * head_blocks)
    if 4 * work >= slots:
        return 1
    return max(1, min(slots // work, MAX_SPLITS, triton.cdiv(max_keys, 2 * cfg.block_n)))


def _max_keys(ring, block_table, comp_kv, comp_idx, rate, page_size) -> int:
    """A bound on any query's key count from shapes alone (no host sync)."""
    n = ring.shape[1]
    if comp_kv is not None:
        n += comp_idx.shape[1] if comp_idx is not None else block_table.shape[1] * page_size // max(1, rate)
    return n


def v4_attention_decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    ring: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    comp_kv: torch.Tensor | None,
    comp_idx: torch.Tensor | None,
    sink: torch.Tensor,
    sm_scale: float,
    rate: int,
    page_size: int,
    *,
    num_splits: int | None = None,
    config: AttnConfig | None = None,
) -> torch.Tensor:
    check_launchable(v4_attn_kernel, q)
    fp8 = _check(q, kv, ring, comp_kv)
    B, H, hd = q.shape
    cfg = config or decode_config(hd, H, cuda_arch(q.device), q.element_size(), B, sm_count(q.device), fp8)
    if num_splits is None:
        num_splits = default_num_splits(
            B,
            triton.cdiv(H, cfg.block_h),
            _max_keys(ring, block_table, comp_kv, comp_idx, rate, page_size),
            cfg,
            q.device,
            programs_per_sm(_occupancy_key(q, cfg, ring, comp_kv, comp_idx), cfg.programs_per_sm),
        )
    ar = torch.arange(B, dtype=torch.int32, device=q.device)
    return _launch(
        q,
        kv,
        ring,
        _i32(slot_ids, q),
        _i32(positions, q),
        ar,
        ar,
        _i32(block_table, q),
        comp_kv,
        comp_idx,
        sink,
        sm_scale,
        rate,
        page_size,
        num_splits,
        cfg,
    )


def v4_attention_extend(
    q: torch.Tensor,
    kv: torch.Tensor,
    ring: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    extend_lens: torch.Tensor,
    block_table: torch.Tensor,
    comp_kv: torch.Tensor | None,
    comp_idx: torch.Tensor | None,
    sink: torch.Tensor,
    sm_scale: float,
    rate: int,
    page_size: int,
    *,
    num_splits: int = 1,
    config: AttnConfig | None = None,
) -> torch.Tensor:
    check_launchable(v4_attn_kernel, q)
    fp8 = _check(q, kv, ring, comp_kv)
    T, H, hd = q.shape
    cfg = config or attn_config(hd, H, cuda_arch(q.device), q.element_size(), fp8)
    token_req, req_row0 = varlen_index(extend_lens.to(q.device), T)
    return _launch(
        q,
        kv,
        ring,
        _i32(slot_ids, q),
        _i32(positions, q),
        token_req,
        req_row0,
        _i32(block_table, q),
        comp_kv,
        comp_idx,
        sink,
        sm_scale,
        rate,
        page_size,
        num_splits,
        cfg,
    )


def _i32(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Index tensors as the kernels read them: int32, contiguous, on the queries' device (a no-op
    when so)."""
    return t.to(device=like.device, dtype=torch.int32).contiguous()


def varlen_index(extend_lens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(request of each row [T], first row of each request [B]) as int32, on the device, without
    reading lengths back to the host."""
    lens = extend_lens.to(torch.int64)
    row0 = torch.cumsum(lens, 0) - lens
    req = torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens, output_size=total)
    return req.to(torch.int32), row0.to(torch.int32)


def aot_variants(arch: int) -> list[KernelVariant]:
    """V4-Flash's attention (64 heads of 512, bf16, page 64) for CSA decode (split), HCA decode
    and CSA extend; fp32 decode; and v4-tiny's (4 heads of 64)."""
    variants = []
    shapes = (
        ("bf16", 512, 64, True, True, True, "csa,decode"),
        ("bf16", 512, 64, True, False, True, "hca,decode"),
        ("bf16", 512, 64, True, True, False, "csa,extend"),
        ("bf16", 512, 64, False, False, False, "swa,extend"),
        ("bf16", 512, 8, True, True, True, "csa,decode"),  # V4-Flash over 8 tensor-parallel ranks
        ("fp32", 512, 64, True, True, True, "csa,decode"),
        ("fp32", 512, 64, True, False, True, "hca,decode"),
        ("fp32", 512, 64, True, True, False, "csa,extend"),
        ("fp32", 512, 64, False, False, False, "swa,extend"),
        ("bf16", 64, 4, True, True, True, "csa,decode"),
    )
    for dtype, hd, heads, has_comp, sparse, split, label in shapes:
        cfg = attn_config(hd, heads, arch, 4 if dtype == "fp32" else 2)
        variants.append(
            KernelVariant(
                name=f"v4_attn[{dtype},d{hd},h{heads},{label}]",
                kernel=v4_attn_kernel,
                types={
                    "q_ptr": f"*{dtype}",
                    "kv_ptr": f"*{dtype}",
                    "ring_ptr": f"*{dtype}",
                    "comp_ptr": f"*{dtype}",
                    "block_table_ptr": "*i32",
                    "comp_idx_ptr": "*i32",
                    "sink_ptr": "*fp32",
                    "positions_ptr": "*i32",
                    "token_req_ptr": "*i32",
                    "req_row0_ptr": "*i32",
                    "slot_ids_ptr": "*i32",
                    "out_ptr": f"*{dtype}",
                    "part_out_ptr": "*fp32",
                    "part_lse_ptr": "*fp32",
                    "qk_scale": "fp32",
                    "num_heads": "i32",
                    "num_splits": "i32",
                    "window": "i32",
                    "rate": "i32",
                    "page_size": "i32",
                    "entries_per_page": "i32",
                    "num_comp_idx": "i32",
                    **{
                        name: "i32"
                        for name in (
                            "stride_q_t",
                            "stride_q_h",
                            "stride_kv_t",
                            "stride_ring_slot",
                            "stride_ring_w",
                            "stride_comp_page",
                            "stride_comp_e",
                            "stride_bt_b",
                            "stride_ci_t",
                            "stride_o_t",
                            "stride_o_h",
                            "stride_po_t",
                            "stride_po_h",
                            "stride_po_s",
                            "stride_pl_t",
                            "stride_pl_h",
                        )
                    },
                },
                constexprs=dict(
                    HEAD_DIM=hd,
                    BLOCK_H=cfg.block_h,
                    BLOCK_N=cfg.block_n,
                    BLOCK_D=next_pow2(hd),
                    HAS_COMP=has_comp,
                    SPARSE=sparse,
                    SPLIT=split,
                    UPCAST=False,
                    KV_FP8=False,
                ),
                num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
            )
        )
    for step in HEAD_TILE_STEPS.values():  # what decode_config falls back to at small batches
        base = variants[0]
        variants.append(
            KernelVariant(
                name=f"v4_attn[bf16,d512,h64,csa,decode,bh{step.block_h}]",
                kernel=v4_attn_kernel,
                types=base.types,
                constexprs={**base.constexprs, "BLOCK_H": step.block_h, "BLOCK_N": step.block_n},
                num_warps=step.num_warps,
                num_stages=step.num_stages,
            )
        )
    # --kv-cache-dtype fp8_e4m3: ring and entries as e4m3 rows + scales (its own tiles)
    for dtype, label, at in (("bf16", "csa,decode", 0), ("bf16", "csa,extend", 2), ("fp32", "csa,decode", 5)):
        base = variants[at]
        cfg = attn_config(512, 64, arch, 4 if dtype == "fp32" else 2, kv_fp8=True)
        variants.append(
            KernelVariant(
                name=f"v4_attn[{dtype},fp8kv,d512,h64,{label}]",
                kernel=v4_attn_kernel,
                types={**base.types, "ring_ptr": "*u8", "comp_ptr": "*u8"},
                constexprs={**base.constexprs, "KV_FP8": True, "BLOCK_H": cfg.block_h, "BLOCK_N": cfg.block_n},
                num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
            )
        )
    variants.append(
        KernelVariant(
            name="v4_attn_merge[bf16,d512]",
            kernel=v4_attn_merge_kernel,
            types={
                "part_out_ptr": "*fp32",
                "part_lse_ptr": "*fp32",
                "sink_ptr": "*fp32",
                "out_ptr": "*bf16",
                "num_splits": "i32",
                **{
                    name: "i32"
                    for name in (
                        "stride_po_t",
                        "stride_po_h",
                        "stride_po_s",
                        "stride_pl_t",
                        "stride_pl_h",
                        "stride_o_t",
                        "stride_o_h",
                    )
                },
            },
            constexprs=dict(HEAD_DIM=512, BLOCK_D=512, BLOCK_S=16),
            num_warps=4,
            num_stages=1,
        )
    )
    return variants[:-1] + fp32_twins(variants[-1:])  # the merge: same tiles in either dtype
