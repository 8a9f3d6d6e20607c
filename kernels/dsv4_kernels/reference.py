"""Pure-torch implementations of the kernel API: the oracle for the Triton kernels and the
engine's CPU backend.

Every function computes in fp32 and returns the input dtype. They are vectorised over tokens:
the only Python loops are over requests (extend, where padding a batch would cost more than it
saves) and over experts that received tokens (MoE).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from dsv4_kernels.grouped_moe import grouped_experts

# Upper bound on fp32 elements of gathered keys/scores held at once; bounds memory on long
# contexts without changing results.
_MAX_GATHER_ELEMS = 1 << 25


def take_pages(kv_cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """``kv_cache[pages]`` -> [*pages.shape, page_size, D], bit for bit, for long ``pages``.

    A page of a pool's layer is one contiguous run of page_size * D values (the pool is
    page-major, so pages are strided by the layer count): index_select over those runs copies
    each page with one memcpy, where advanced indexing walks it element by element (measured
    6x slower on a CPU core for 108 pages of [16, 576] fp32)."""
    n, page_size, dim = kv_cache.shape
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != dim:
        return kv_cache[pages]
    runs = kv_cache.view(n, page_size * dim)  # [num_pages, page_size * D], strided rows
    return runs.index_select(0, pages.reshape(-1)).view(*pages.shape, page_size, dim)


def _gather_pages(kv_cache: torch.Tensor, pages: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Rows 0..num_tokens-1 of the paged cache along ``pages`` ([..., n_pages]) as fp32."""
    rows = take_pages(kv_cache, pages)  # [..., n_pages, page_size, D]; works on strided views of a pool
    rows = rows.reshape(*pages.shape[:-1], -1, kv_cache.shape[-1])[..., :num_tokens, :]
    return rows.float()


def _length_buckets(lens: list[int], row_elems: int) -> list[list[int]]:
    """Requests grouped by length, longest first, so that padding a group to its longest
    member at most doubles its work, and a group's gathered keys stay bounded."""
    order = sorted((b for b, n in enumerate(lens) if n > 0), key=lambda b: -lens[b])
    buckets: list[list[int]] = []
    for b in order:
        cur = buckets[-1] if buckets else None
        if cur is None or 2 * lens[b] < lens[cur[0]] or (len(cur) + 1) * lens[cur[0]] * row_elems > _MAX_GATHER_ELEMS:
            buckets.append([b])
        else:
            cur.append(b)
    return buckets


def mla_decode_gathered(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    v_dim: int,
) -> torch.Tensor:
    """The earlier decode: every request's whole context gathered into one tensor per length
    bucket, then two bmms over it (reads the lengths on the host). Kept as the benchmark's
    baseline and as a second oracle for ``mla_decode``."""
    batch, heads, dim = q.shape
    out = torch.zeros(batch, heads, v_dim, dtype=q.dtype, device=q.device)
    page_size = kv_cache.shape[1]
    lens = seq_lens.tolist()
    for bucket in _length_buckets(lens, max(dim, heads)):
        idx = torch.tensor(bucket, device=q.device)
        max_len = lens[bucket[0]]
        n_pages = -(-max_len // page_size)
        blens = seq_lens.to(device=q.device, dtype=torch.long)[idx]
        used = torch.arange(n_pages, device=q.device)[None, :] * page_size < blens[:, None]
        pages = torch.where(used, block_table[idx, :n_pages].to(torch.long), 0)
        keys = _gather_pages(kv_cache, pages, max_len)  # [b, L, D]
        scores = torch.bmm(q[idx].float(), keys.transpose(1, 2)) * sm_scale  # [b, H, L]
        masked = torch.arange(max_len, device=q.device)[None, :] >= blens[:, None]
        scores.masked_fill_(masked[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[idx] = torch.bmm(probs, keys[..., :v_dim]).to(q.dtype)
    return out


# Keys one decode block reads at a time: the tile [B, block, D] is bounded whatever the
# context, and both matmuls use it while it is fresh in cache (one read of each page from
# memory, where a whole-context gather wrote and re-read a [B, L, D] copy). Tune with
# bench/attention_forms.py on a quiet machine.
DECODE_BLOCK_TOKENS = 256
# ... and the requests one pass takes at a time: a tile of at most this many bytes of keys. A
# whole batch's tile at once ([32, 256, 576] fp32 is 19 MB) falls out of the cache between the
# gather and the two matmuls; bench/ab_attention.py measured 32 requests of ~160 tokens at the
# mla512 width 1.5-3x faster in chunks of 4-9 than at once, bit for bit the same (each
# request's matmuls are its own). Each chunk costs ~30 more small ops, so the budget is the
# larger of the two that measured alike there (2 and 4 MiB).
DECODE_TILE_BYTES = 4 << 20


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    v_dim: int,
) -> torch.Tensor:
    """One query token per request over its paged latent cache (MQA: all heads share it).

    q [B, H, D], kv_cache [num_pages, page_size, D] (any strides, last dim contiguous),
    block_table [B, width] (entries past a request's pages may hold anything), seq_lens [B]
    -> [B, H, v_dim]; value = first v_dim columns. A request with seq_len 0 (batch padding)
    gets zeros.

    Page-blocked flash decoding: the block table is walked in blocks of columns, each block's
    pages read straight into a small cache-resident tile and folded into a running
    log-sum-exp, a few requests at a time (DECODE_TILE_BYTES). The loop counts come from the
    table's width and the batch size (shapes), never from the lengths: no host read, no
    data-dependent shape, the same ops for any content (CUDA-graph safe on the torch backend too).
    """
    batch, heads, dim = q.shape
    page_size = kv_cache.shape[1]
    width = block_table.shape[1]
    per_block = max(1, DECODE_BLOCK_TOKENS // page_size)
    rows = max(1, DECODE_TILE_BYTES // (min(width, per_block) * page_size * dim * 4))
    if batch > rows:
        out = torch.empty(batch, heads, v_dim, dtype=q.dtype, device=q.device)
        for b0 in range(0, batch, rows):
            out[b0 : b0 + rows] = _mla_decode_rows(
                q[b0 : b0 + rows], kv_cache, block_table[b0 : b0 + rows], seq_lens[b0 : b0 + rows], sm_scale, v_dim
            )
        return out
    return _mla_decode_rows(q, kv_cache, block_table, seq_lens, sm_scale, v_dim)


def _mla_decode_rows(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    v_dim: int,
) -> torch.Tensor:
    batch, heads, dim = q.shape
    page_size = kv_cache.shape[1]
    width = block_table.shape[1]
    per_block = max(1, DECODE_BLOCK_TOKENS // page_size)
    qs = q.float() * sm_scale
    lens = seq_lens.to(device=q.device, dtype=torch.long)
    m = acc = den = None
    for c0 in range(0, width, per_block):
        cols = block_table[:, c0 : c0 + per_block].to(torch.long)  # [B, k]
        n = cols.shape[1] * page_size
        # Table entries past a request's last page may hold anything (padding, -1): read page 0.
        first = torch.arange(c0, c0 + cols.shape[1], device=q.device)[None, :] * page_size
        cols = torch.where(first < lens[:, None], cols, 0)
        keys = take_pages(kv_cache, cols).reshape(batch, n, dim).float()  # [B, n, D]
        s = torch.bmm(qs, keys.transpose(1, 2))  # [B, H, n]
        past_end = torch.arange(c0 * page_size, c0 * page_size + n, device=q.device)[None, :] >= lens[:, None]
        s.masked_fill_(past_end[:, None, :], float("-inf"))
        bm = s.amax(-1, keepdim=True)  # [B, H, 1]
        if m is None:
            m_new = bm
        else:
            m_new = torch.maximum(m, bm)
        m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)  # a block with no live key: weights 0
        p = torch.exp(s - m_safe)
        block_acc = torch.bmm(p, keys[..., :v_dim])
        if m is None:
            acc, den = block_acc, p.sum(-1, keepdim=True)
        else:
            alpha = torch.exp(m - m_safe)
            acc = acc * alpha + block_acc
            den = den * alpha + p.sum(-1, keepdim=True)
        m = m_new
    if m is None:
        return torch.zeros(batch, heads, v_dim, dtype=q.dtype, device=q.device)
    return (acc / torch.where(den > 0, den, 1.0)).to(q.dtype)


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
) -> torch.Tensor:
    """Causal attention of new tokens over their whole (already cached) sequence.

    q [T, H, D] concatenates the new tokens of every request; request b's extend_lens[b] tokens
    are the last positions of its seq_lens[b] cached tokens, and the token at absolute position
    p attends to positions 0..p. Returns [T, H, v_dim]. max_extend_len is the Triton
    launcher's host-side bound, accepted for the same signature; here the lengths are read.
    """
    total, heads, dim = q.shape
    out = torch.empty(total, heads, v_dim, dtype=q.dtype, device=q.device)
    page_size = kv_cache.shape[1]
    lens = seq_lens.tolist()
    exts = extend_lens.tolist()
    if sum(exts) != total:
        raise ValueError(f"sum(extend_lens)={sum(exts)} does not match q.shape[0]={total}")
    start = 0
    for b, (seq_len, ext) in enumerate(zip(lens, exts)):
        if ext == 0:
            continue
        n_pages = -(-seq_len // page_size)
        keys = _gather_pages(kv_cache, block_table[b, :n_pages].to(torch.long), seq_len)  # [S, D]
        values = keys[:, :v_dim]
        key_pos = torch.arange(seq_len, device=q.device)
        # Chunk the new tokens so the [tokens, H, S] score block stays bounded.
        step = max(1, _MAX_GATHER_ELEMS // (heads * seq_len))
        for t0 in range(0, ext, step):
            t1 = min(ext, t0 + step)
            qb = q[start + t0 : start + t1].float()  # [n, H, D]
            scores = torch.matmul(qb, keys.t()) * sm_scale  # [n, H, S]
            q_pos = torch.arange(seq_len - ext + t0, seq_len - ext + t1, device=q.device)
            future = key_pos[None, :] > q_pos[:, None]  # [n, S]
            scores.masked_fill_(future[:, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[start + t0 : start + t1] = torch.matmul(probs, values).to(q.dtype)
        start += ext
    return out


def moe_route(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    n_group: int,
    topk_group: int,
    top_k: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 ``noaux_tc`` routing: sigmoid scores, bias-corrected grouped top-k.

    Returns (weights fp32 [T, top_k], expert ids int32 [T, top_k]), ordered by descending
    bias-corrected score. Matches transformers' DeepseekV3TopkRouter up to ties.
    """
    num_tokens, num_experts = router_logits.shape
    scores = router_logits.float().sigmoid()
    choice = scores + correction_bias.float()
    per_group = num_experts // n_group
    group_scores = choice.view(num_tokens, n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = group_scores.topk(topk_group, dim=-1)[1]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    expert_mask = group_mask.repeat_interleave(per_group, dim=1)
    choice = choice.masked_fill(~expert_mask, float("-inf"))
    topk_ids = choice.topk(top_k, dim=-1)[1]
    return route_weights(scores, topk_ids, norm_topk_prob, routed_scaling_factor)


def route_weights(
    scores: torch.Tensor, topk_ids: torch.Tensor, norm_topk_prob: bool, routed_scaling_factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen experts' weights (their sigmoid scores, normalised, scaled) and int32 ids:
    what every form of the routing does once the experts are chosen."""
    weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, topk_ids.to(torch.int32)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """grouped_experts' activation: silu(gate) * up of gate_up [P, 2I] -> [P, I]."""
    inter = gate_up.shape[1] // 2
    return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]


def moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    add: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Routed experts: out[t] = sum_k w[t,k] * w2[e] @ (silu(gate_e x) * (up_e x)), e = ids[t,k].

    x [T, hidden], w13 [E, 2I, hidden] (gate rows, then up rows), w2 [E, hidden, I].
    Computed in fp32 over the pairs grouped by expert (`grouped_experts`). A pair whose id is
    outside [0, E) adds nothing and costs nothing (tensor parallelism: -1 marks another rank's
    expert). `add` [T, hidden] in x's dtype (the shared expert's output) is added to the result
    as `out + add` would, in the same pass where it can be.
    """
    if add is not None and x.dtype != torch.float32:
        return grouped_experts(x, w13, w2, topk_weights, topk_ids, silu_mul).to(x.dtype) + add
    return grouped_experts(x, w13, w2, topk_weights, topk_ids, silu_mul, add=add).to(x.dtype)


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm with an optional fused residual add, rounded like HF's DeepseekV3RMSNorm.

    With a residual: residual_out = x + residual (in x's dtype) and out normalises it;
    without: residual_out is x. The normalised value is cast to x's dtype before the weight
    multiply, as HF does; out has x's dtype.
    """
    hidden = x if residual is None else x + residual
    h32 = hidden.float()
    normed = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    out = (weight.float() * normed.to(x.dtype).float()).to(x.dtype)
    return out, hidden


def rope_interleaved_(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """Rotate interleaved pairs (x[..., 2i], x[..., 2i+1]) in place by angle i at each position.

    x [T, H, R] (may be a strided view), positions [T], cos/sin [max_pos, R // 2] fp32.
    The result stays interleaved.
    """
    c = cos[positions].float().unsqueeze(1)  # [T, 1, R/2]
    s = sin[positions].float().unsqueeze(1)
    even = x[..., 0::2]
    odd = x[..., 1::2]
    a = even.float()
    b = odd.float()
    # Both results exist before either write: for fp32, a and b alias x.
    new_even = a * c - b * s
    new_odd = a * s + b * c
    even.copy_(new_even)
    odd.copy_(new_odd)
    return x


# DeepSeek-V4's kernels live in their own module; the torch backend exposes them with the rest.
from dsv4_kernels.reference_v4 import (  # noqa: E402,F401
    v4_attention_decode,
    v4_attention_extend,
    v4_compress_pool,
    v4_hc_post,
    v4_hc_pre,
    v4_indexer_topk,
    v4_moe_experts,
    v4_moe_route,
)
