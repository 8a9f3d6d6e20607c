"""DeepSeek-V4 lightning indexer: score every visible compressed indexer key of a query and
keep the top-k, without materialising the [queries, entries] score matrix.

Program (query t, split s) walks every num_splits-th of the request's indexer key tiles in
place (paged, via the block table), scores a BLOCK_N tile with one [heads, d] x [d, BLOCK_N] dot
(relu, weighted sum over heads), and folds it into a running top-K held in registers. A
candidate is one int64: the score's order-preserving integer bits above, (2^31 - 1 - entry)
below, so one descending sort ranks by score and breaks ties toward the lower entry (the
reference's stable sort). A tile whose best candidate does not beat the current K-th is skipped
without sorting, which on long contexts is most tiles once the buffer fills. A second kernel
merges a query's splits (one split: it only decodes the candidates): candidates are unique, so
the picks are the same however the tiles were split. Splitting lets decode at small batch fill
the device (one program a query used to run over all its keys).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import KernelVariant, check_grid, check_launchable, cuda_arch, next_pow2, on_interpreter, sm_count
from .v4_attention import _i32, varlen_index


EMPTY_KEY = -9223372036854775807 - 1  # below every encoded candidate (kernels spell it out)


@triton.jit
def _scan_keys(
    iq_ptr,
    iw_ptr,
    ik_ptr,
    block_table_ptr,
    positions_ptr,
    token_req_ptr,
    t,
    n_begin,
    n_step,
    scale,
    rate,
    page_size,
    entries_per_page,
    stride_q_t,
    stride_q_h,
    stride_w_t,
    stride_k_page,
    stride_k_e,
    stride_bt_b,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_IH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_PAD: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Query t's best K_PAD encoded candidates among its visible entries in the BLOCK_N tiles
    starting at n_begin, n_begin + n_step, ..."""
    p = tl.load(positions_ptr + t).to(tl.int32)
    b = tl.load(token_req_ptr + t)
    count = (p + 1) // rate

    h = tl.arange(0, BLOCK_IH)
    h_mask = h < NUM_HEADS
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        iq_ptr + t.to(tl.int64) * stride_q_t + h[:, None] * stride_q_h + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    hw = tl.load(iw_ptr + t.to(tl.int64) * stride_w_t + h, mask=h_mask, other=0.0).to(tl.float32) * scale

    EMPTY: tl.constexpr = -9223372036854775807 - 1
    best = tl.full([K_PAD], EMPTY, tl.int64)
    kth = tl.min(best, 0)  # the K-th best so far (EMPTY until K candidates were seen)
    rows_blk = tl.arange(0, K_PAD // BLOCK_N)
    half = tl.arange(0, 2)
    table = block_table_ptr + b.to(tl.int64) * stride_bt_b
    for n0 in range(n_begin, count, n_step):
        n = n0 + tl.arange(0, BLOCK_N)
        ok = n < count
        page = tl.load(table + (n * rate) // page_size, mask=ok, other=0).to(tl.int64)
        rows = ik_ptr + page * stride_k_page + (n % entries_per_page).to(tl.int64) * stride_k_e
        if KV_FP8:
            # --kv-cache-dtype fp8_e4m3 (dsv4_engine.kv_quant): HEAD_DIM e4m3 bytes, then the
            # key's float32 scale; converted in the tile, scored in q's dtype
            k = tl.load(rows[:, None] + offs_d[None, :], mask=ok[:, None] & d_mask[None, :], other=0)
            k_scale = tl.load((rows + HEAD_DIM).to(tl.pointer_type(tl.float32)), mask=ok, other=0.0)
            k = (k.to(tl.float8e4nv, bitcast=True).to(tl.float32) * k_scale[:, None]).to(q.dtype)
        else:
            k = tl.load(rows[:, None] + offs_d[None, :], mask=ok[:, None] & d_mask[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(k, tl.trans(q), input_precision="ieee")  # [BLOCK_N, heads]
        score = tl.sum(tl.maximum(s, 0.0) * hw[None, :], 1)
        score = tl.where(score == 0.0, 0.0, score)  # -0.0 ranks as +0.0, as in torch
        bits = score.to(tl.int32, bitcast=True)
        skey = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # monotone in the float's value
        key = skey.to(tl.int64) * 4294967296 + (2147483647 - n).to(tl.int64)
        key = tl.where(ok, key, EMPTY)
        if tl.max(key, 0) > kth:
            blk = tl.where(rows_blk[:, None] == 0, key[None, :], EMPTY)  # the tile, padded to K_PAD
            both = tl.reshape(tl.join(best, tl.reshape(blk, [K_PAD])), [2 * K_PAD])
            both = tl.sort(both, descending=True)
            both = tl.reshape(both, [2, K_PAD])
            best = tl.max(tl.where(half[:, None] == 0, both, EMPTY), 0)
            kth = tl.min(best, 0)
    return best


@triton.jit
def _store_picks(out_ptr, t, stride_o_t, best, top_k, K_PAD: tl.constexpr):
    """Decode the candidates to entry numbers (-1 where empty) and store the first top_k."""
    kk = tl.arange(0, K_PAD)
    empty = best == (-9223372036854775807 - 1)
    idx = tl.where(empty, -1, 2147483647 - (best & 4294967295)).to(tl.int32)
    tl.store(out_ptr + t.to(tl.int64) * stride_o_t + kk, idx, mask=kk < top_k)


@triton.jit
def v4_indexer_topk_kernel(
    iq_ptr,
    iw_ptr,
    ik_ptr,
    block_table_ptr,
    positions_ptr,
    token_req_ptr,
    part_ptr,
    num_splits,
    scale,
    rate,
    page_size,
    entries_per_page,
    stride_q_t,
    stride_q_h,
    stride_w_t,
    stride_k_page,
    stride_k_e,
    stride_bt_b,
    stride_p_t,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_IH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_PAD: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr = False,
):
    """Program (t, s) scans query t's tiles s, s + num_splits, s + 2 * num_splits, ... (interleaved,
    so every split has work whatever the query's context, which the launch cannot know) and
    writes its best K_PAD encoded candidates (empties where it found fewer)."""
    t = tl.program_id(0)
    s = tl.program_id(1)
    best = _scan_keys(
        iq_ptr, iw_ptr, ik_ptr, block_table_ptr, positions_ptr, token_req_ptr, t, s * BLOCK_N,
        num_splits * BLOCK_N, scale, rate, page_size, entries_per_page, stride_q_t, stride_q_h, stride_w_t,
        stride_k_page, stride_k_e, stride_bt_b, NUM_HEADS, HEAD_DIM, BLOCK_IH, BLOCK_D, BLOCK_N, K_PAD, UPCAST, KV_FP8,
    )  # fmt: skip
    kk = tl.arange(0, K_PAD)
    tl.store(part_ptr + t.to(tl.int64) * stride_p_t + s * K_PAD + kk, best)


@triton.jit
def v4_indexer_merge_kernel(part_ptr, out_ptr, num_splits, top_k, stride_p_t, stride_o_t, K_PAD: tl.constexpr):
    """Fold query t's split candidates, split by split, into one top-K_PAD. Candidates encode
    (score, entry) uniquely, so the merge picks exactly what one serial scan picks."""
    t = tl.program_id(0)
    kk = tl.arange(0, K_PAD)
    half = tl.arange(0, 2)
    row = part_ptr + t.to(tl.int64) * stride_p_t
    best = tl.load(row + kk)
    for s in range(1, num_splits):
        blk = tl.load(row + s * K_PAD + kk)
        if tl.max(blk, 0) > tl.min(best, 0):  # a split with nothing better (or nothing: short contexts) costs no sort
            both = tl.sort(tl.reshape(tl.join(best, blk), [2 * K_PAD]), descending=True)
            best = tl.max(tl.where(half[:, None] == 0, tl.reshape(both, [2, K_PAD]), -9223372036854775807 - 1), 0)
    _store_picks(out_ptr, t, stride_o_t, best, top_k, K_PAD)


def indexer_tiles(top_k: int, elem_size: int = 2, arch: int | None = None) -> tuple[int, int, int]:
    """(K_PAD, BLOCK_N, num_warps): the running buffer (a power of two, >= 16 for the GPU's
    dot), the key tile (at most the buffer, so a padded tile joins it in one sort) and the
    warps. From the AOT reports: fp32 keys (FMA dots) at 64 heads x 128 spill on every target
    with 4 or 8 warps, so they take 16-row tiles on 16 warps; on sm_100 a 64-row bf16 tile
    takes tcgen05, and triton 3.7's TMEM layout pass then crashes on the sort that follows,
    so sm_100 takes 32-row tiles (mma.sync) on 4 warps."""
    k_pad = max(16, next_pow2(top_k))
    if elem_size > 2 and k_pad >= 256:
        return k_pad, 16, 16
    if arch == 100:
        return k_pad, min(32, k_pad), 4
    return k_pad, min(64, k_pad), 8 if k_pad >= 256 else 4


# A merge folds at most this many splits per query (a sort of 2 * K_PAD each, serially, for
# the splits that hold a candidate better than the running K-th).
MAX_SPLITS = 32


def indexer_splits(num_tokens: int, max_entries: int, block_n: int, sms: int) -> int:
    """How many programs share each query's key scan (each takes every num_splits-th tile).
    From shapes alone (the block table's width bounds a request's entries), so a captured
    decode graph replays the same split: enough programs for two waves of the device's SMs,
    no more splits than tiles, at most MAX_SPLITS; one when the queries already fill the
    device (the merge then only decodes the candidates)."""
    if num_tokens <= 0 or max_entries <= 0:
        return 1
    return max(1, min(MAX_SPLITS, triton.cdiv(2 * sms, num_tokens), triton.cdiv(max_entries, block_n)))


def v4_indexer_topk(
    iq: torch.Tensor,
    iw: torch.Tensor,
    index_k: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    extend_lens: torch.Tensor,
    top_k: int,
    scale: float,
    rate: int,
    page_size: int,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """num_splits: programs per query over its keys (None: indexer_splits from the shapes)."""
    check_launchable(v4_indexer_topk_kernel, iq)
    T, IH, d = iq.shape
    out = torch.empty(T, top_k, dtype=torch.int32, device=iq.device)
    if T == 0:
        return out
    if iq.stride(-1) != 1 or index_k.stride(-1) != 1:
        raise ValueError("v4_indexer_topk needs the last dim of iq and index_k contiguous")
    kv_fp8 = index_k.dtype == torch.uint8  # packed FP8 keys with their scales (dsv4_engine.kv_quant)
    if kv_fp8 and index_k.shape[-1] != d + 4:
        raise ValueError(f"v4_indexer_topk: FP8 index_k rows are {index_k.shape[-1]} bytes, not {d} + 4")
    if iq.dtype != index_k.dtype and not kv_fp8:
        raise ValueError(f"v4_indexer_topk: iq is {iq.dtype} but index_k is {index_k.dtype}")
    token_req, _ = varlen_index(extend_lens.to(iq.device), T)
    k_pad, block_n, num_warps = indexer_tiles(top_k, iq.element_size(), cuda_arch(iq.device))
    max_entries = block_table.shape[1] * page_size // rate
    if num_splits is None and on_interpreter(iq):
        splits = 1  # every program costs the interpreter CPU time: tests ask for splits
    elif num_splits is None:
        splits = indexer_splits(T, max_entries, block_n, sm_count(iq.device))
    else:
        splits = max(1, int(num_splits))
    iw = iw.float().contiguous()
    common = (
        iq,
        iw,
        index_k,
        _i32(block_table, iq),
        _i32(positions, iq),
        token_req,
    )
    strides = (
        scale,
        rate,
        page_size,
        index_k.shape[1],
        iq.stride(0),
        iq.stride(1),
        iw.stride(0),
        index_k.stride(0),
        index_k.stride(1),
        block_table.stride(0),
    )
    shapes = dict(
        NUM_HEADS=IH,
        HEAD_DIM=d,
        BLOCK_IH=max(16, next_pow2(IH)),
        BLOCK_D=max(16, next_pow2(d)),
        BLOCK_N=block_n,
        K_PAD=k_pad,
        UPCAST=on_interpreter(iq),
        KV_FP8=kv_fp8,
        num_warps=num_warps,
        num_stages=2,
    )
    part = torch.empty(T, splits * k_pad, dtype=torch.int64, device=iq.device)
    v4_indexer_topk_kernel[check_grid((T, splits))](*common, part, splits, *strides, part.stride(0), **shapes)
    v4_indexer_merge_kernel[(T,)](
        part, out, splits, top_k, part.stride(0), out.stride(0), K_PAD=k_pad, num_warps=merge_warps(k_pad)
    )
    return out


def merge_warps(k_pad: int) -> int:
    return 8 if k_pad >= 256 else 4


def aot_variants(arch: int) -> list[KernelVariant]:
    """V4-Flash's indexer (64 heads of 128, top-512) in bf16 and fp32, and v4-tiny's (8 x 32,
    top-4): the serial scan, the split scan and the merge of the splits."""
    variants = []
    strides = ("stride_q_t", "stride_q_h", "stride_w_t", "stride_k_page", "stride_k_e", "stride_bt_b")
    for dtype, ih, d, top_k in (("bf16", 64, 128, 512), ("fp32", 64, 128, 512), ("bf16", 8, 32, 4)):
        k_pad, block_n, num_warps = indexer_tiles(top_k, 4 if dtype == "fp32" else 2, arch)
        types = {
            "iq_ptr": f"*{dtype}",
            "iw_ptr": "*fp32",
            "ik_ptr": f"*{dtype}",
            "block_table_ptr": "*i32",
            "positions_ptr": "*i32",
            "token_req_ptr": "*i32",
            "scale": "fp32",
            "rate": "i32",
            "page_size": "i32",
            "entries_per_page": "i32",
            **{name: "i32" for name in strides},
        }
        constexprs = dict(
            NUM_HEADS=ih,
            HEAD_DIM=d,
            BLOCK_IH=max(16, next_pow2(ih)),
            BLOCK_D=max(16, next_pow2(d)),
            BLOCK_N=block_n,
            K_PAD=k_pad,
            UPCAST=False,
            KV_FP8=False,
        )
        label = f"{dtype},h{ih},d{d},k{top_k}"
        variants.append(
            KernelVariant(
                name=f"v4_indexer_topk[{label}]",
                kernel=v4_indexer_topk_kernel,
                types={**types, "part_ptr": "*i64", "num_splits": "i32", "stride_p_t": "i32"},
                constexprs=constexprs,
                num_warps=num_warps,
                num_stages=2,
            )
        )
        if dtype == "bf16" and top_k == 512:  # --kv-cache-dtype fp8_e4m3: e4m3 keys and their scales
            variants.append(
                KernelVariant(
                    name=f"v4_indexer_topk[{dtype},fp8kv,h{ih},d{d},k{top_k}]",
                    kernel=v4_indexer_topk_kernel,
                    types={**types, "ik_ptr": "*u8", "part_ptr": "*i64", "num_splits": "i32", "stride_p_t": "i32"},
                    constexprs={**constexprs, "KV_FP8": True},
                    num_warps=num_warps,
                    num_stages=2,
                )
            )
        if dtype == "fp32":
            continue  # the merge folds int64 candidates: no activation dtype, one compile per K
        variants.append(
            KernelVariant(
                name=f"v4_indexer_merge[k{top_k}]",
                kernel=v4_indexer_merge_kernel,
                types={
                    "part_ptr": "*i64",
                    "out_ptr": "*i32",
                    "num_splits": "i32",
                    "top_k": "i32",
                    "stride_p_t": "i32",
                    "stride_o_t": "i32",
                },
                constexprs=dict(K_PAD=k_pad),
                num_warps=merge_warps(k_pad),
                num_stages=1,
            )
        )
    return variants
