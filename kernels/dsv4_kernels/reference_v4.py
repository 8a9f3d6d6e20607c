"""Pure-torch DeepSeek-V4 kernels: the test oracle of the Triton V4 kernels. The engine does not
run them: on the torch backend the V4 model keeps its own batched torch path (the same math,
tuned for the CPU), and the kernel path runs only on a backend that asks for it (Triton; the
engine-backend tests also drive it through these functions). The math is the V4 model's
(engine/dsv4_engine/models/deepseek_v4.py), cut at the seams where a kernel takes over; names
and signatures match dsv4_kernels.triton_kernels.v4_*.

Shared conventions
- Tokens are flattened over requests (varlen): request b owns extend_lens[b] consecutive rows,
  at consecutive positions; positions [T] gives each row's absolute position.
- The sliding-window ring of one layer is ``ring`` [max_requests, W, hd] (row = slot id,
  entry = position % W) and holds the last W tokens BEFORE this step's chunk: the chunk's own
  keys come from ``kv`` [T, hd]. A query at p sees window positions (p - W, p].
- Compressed entries of one layer live in a paged store [num_pages, entries_per_page, dim];
  entry w of request b sits in page block_table[b, (w * rate) // page_size] at offset
  w % entries_per_page (StateSpec.entry_location). A query at p may see entries w < (p+1) // rate.
- CSA picks entries by the indexer (``comp_idx`` [T, top_k] int32, -1 = none); HCA (comp_idx
  None) sees every visible entry.
- Ties in the indexer's top-k go to the lower entry number (a stable sort), in both backends.
- --kv-cache-dtype fp8_e4m3: the ring, the entries and the indexer keys may be packed FP8 rows
  (uint8, dim + 4 bytes: e4m3 values then a float32 scale, reference_quant.unpack_kv_rows);
  every read converts them, as the kernels do in their tile loops. ``kv`` stays in q's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4_kernels.grouped_moe import grouped_experts
from dsv4_kernels.reference_quant import unpack_kv_rows

__all__ = [
    "v4_attention_decode",
    "v4_attention_extend",
    "v4_indexer_topk",
    "v4_compress_pool",
    "v4_hc_pre",
    "v4_hc_post",
    "v4_moe_route",
    "v4_moe_experts",
]


def _entry_rows(store: torch.Tensor, pages: torch.Tensor, w: torch.Tensor, rate: int, page_size: int) -> torch.Tensor:
    """store[...] rows of entries w (any shape; values < 0 read entry 0) of requests whose page
    ids are ``pages`` (broadcastable against w's leading dims)."""
    w = w.clamp(min=0).long()
    slot = (w * rate) // page_size
    page = torch.gather(pages.long(), -1, slot) if pages.dim() == w.dim() else pages.long()[slot]
    return store[page, w % store.shape[1]]


def _attend(
    q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, sink: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """q [N, H, hd] over keys (== values) [N, K, hd] with allowed [N, K] and the per-head sink
    as one more logit whose value is dropped (the model's _softmax_attend)."""
    logits = torch.matmul(q, keys.transpose(-1, -2)) * sm_scale  # [N, H, K]
    logits = logits.masked_fill(~allowed.unsqueeze(-2), float("-inf"))
    sink_col = sink.to(logits.dtype).view(1, -1, 1).expand(logits.shape[0], -1, 1)
    logits = torch.cat([logits, sink_col], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1)[..., :-1]
    return torch.matmul(probs.to(keys.dtype), keys)


def _ring_keys(ring: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's ring rows [B, W, hd] and the position each slot holds before ``starts``
    [B] is written (negative: never written)."""
    W = ring.shape[1]
    j = torch.arange(W, device=ring.device)
    pos = (starts[:, None] - 1) - torch.remainder(starts[:, None] - 1 - j, W)
    return ring[slots.long()], pos


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
) -> torch.Tensor:
    """V4 attention of a varlen batch of chunks: q [T, H, hd] over its window (ring rows before
    the chunk, then the chunk's own kv [T, hd], causal) plus compressed entries (none when
    comp_kv is None). Returns [T, H, hd]; nothing is written."""
    W = ring.shape[1]
    out = torch.empty_like(q)
    lens = extend_lens.tolist()
    row = 0
    for b, n in enumerate(lens):
        if n == 0:
            continue
        sl = slice(row, row + n)
        qpos = positions[sl]
        start = int(qpos[0])
        ring_rows, ring_pos = _ring_keys(ring, slot_ids[b : b + 1], qpos[:1])
        keys = torch.cat([unpack_kv_rows(ring_rows[0], kv.dtype), kv[sl]], 0)
        kpos = torch.cat([ring_pos[0], qpos])
        allowed = (kpos[None] <= qpos[:, None]) & (kpos[None] > qpos[:, None] - W) & (kpos[None] >= 0)
        allowed = allowed.expand(n, -1)
        keys = keys.unsqueeze(0).expand(n, -1, -1)
        if comp_kv is not None:
            if comp_idx is not None:
                idx = comp_idx[sl]
                entries = _entry_rows(comp_kv, block_table[b], idx, rate, page_size)  # [n, K, hd]
                ok = idx >= 0
            else:
                count = (start + n) // rate
                w = torch.arange(count, device=q.device)
                entries = _entry_rows(comp_kv, block_table[b], w, rate, page_size).unsqueeze(0).expand(n, -1, -1)
                ok = w[None] < ((qpos + 1) // rate)[:, None]
            keys = torch.cat([keys, unpack_kv_rows(entries, kv.dtype)], 1)
            allowed = torch.cat([allowed, ok], 1)
        out[sl] = _attend(q[sl], keys, allowed, sink, sm_scale)
        row += n
    return out


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
) -> torch.Tensor:
    """One new token per request (q [B, H, hd], its own kv [B, hd]): v4_attention_extend with
    every extend length 1, batched over requests."""
    W = ring.shape[1]
    t = positions
    ring_rows, ring_pos = _ring_keys(ring, slot_ids, t)
    keys = torch.cat([unpack_kv_rows(ring_rows, kv.dtype), kv[:, None]], 1)  # [B, W+1, hd]
    kpos = torch.cat([ring_pos, t[:, None]], 1)
    allowed = (kpos > t[:, None] - W) & (kpos >= 0)
    if comp_kv is not None:
        if comp_idx is not None:
            entries = _entry_rows(comp_kv, block_table, comp_idx, rate, page_size)  # [B, K, hd]
            ok = comp_idx >= 0
        else:
            counts = (t + 1) // rate
            C = int(counts.max()) if counts.numel() else 0
            w = torch.arange(C, device=q.device)[None].expand(len(t), -1)
            ok = w < counts[:, None]
            entries = _entry_rows(comp_kv, block_table, torch.where(ok, w, 0), rate, page_size)
        keys = torch.cat([keys, unpack_kv_rows(entries, kv.dtype)], 1)
        allowed = torch.cat([allowed, ok], 1)
    return _attend(q, keys, allowed, sink, sm_scale)


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
) -> torch.Tensor:
    """Lightning indexer: for each query t, score every visible compressed indexer key k_w
    (w < (p+1) // rate) as sum_h iw[t,h] * relu(iq[t,h] . k_w) * scale and return the top_k
    entry numbers [T, top_k] int32, best first (ties: lower w), -1 where fewer are visible.
    iq [T, IH, d], iw [T, IH], index_k a paged store [num_pages, epp, d]."""
    T = iq.shape[0]
    out = torch.full((T, top_k), -1, dtype=torch.int32, device=iq.device)
    lens = extend_lens.tolist()
    row = 0
    for b, n in enumerate(lens):
        if n == 0:
            continue
        sl = slice(row, row + n)
        row += n
        qpos = positions[sl]
        count = (int(qpos[-1]) + 1) // rate
        if count == 0:
            continue
        w = torch.arange(count, device=iq.device)
        keys = unpack_kv_rows(_entry_rows(index_k, block_table[b], w, rate, page_size), torch.float32)  # [C, d]
        score = torch.matmul(iq[sl].float(), keys.t())  # [n, IH, C]
        score = (F.relu(score) * scale * iw[sl].float().unsqueeze(-1)).sum(dim=-2)  # [n, C]
        visible = w[None] < ((qpos + 1) // rate)[:, None]
        score = score.masked_fill(~visible, float("-inf"))
        order = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :top_k]
        chosen = torch.gather(visible, 1, order)
        k = order.shape[1]
        out[sl, :k] = torch.where(chosen, order, -1).to(torch.int32)
    return out


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
    """Compressed entries of windows w_ids [N] from their projections win_kv / win_gate
    [N, rate, width] (any row strides): gated softmax pooling of gate + ape [rate, width] over
    the window's rows, then RMS norm (rope is the caller's). With the overlapping CSA compressor
    (prev_* given, width = 2 * hd) a window pools window w-1's first series (prev[..., :hd])
    with its own second series (win[..., hd:]); window 0 has no predecessor. -> [N, hd]."""
    win_gate = win_gate + ape
    if prev_kv is not None:
        hd = win_kv.shape[-1] // 2
        none = (w_ids < 1)[:, None, None]
        pk = prev_kv[..., :hd].masked_fill(none, 0)
        pg = (prev_gate + ape)[..., :hd].masked_fill(none, float("-inf"))
        new_kv = torch.cat([pk, win_kv[..., hd:]], dim=1)
        new_gate = torch.cat([pg, win_gate[..., hd:]], dim=1)
    else:
        new_kv, new_gate = win_kv, win_gate
    pooled = (new_kv * new_gate.softmax(dim=1, dtype=torch.float32).to(new_kv.dtype)).sum(dim=1)
    pf = pooled.float()
    normed = pf * torch.rsqrt(pf.pow(2).mean(-1, keepdim=True) + eps)
    return (norm_weight * normed).to(win_kv.dtype)


def v4_hc_pre(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC before a sublayer: x [T, hc, D] residual streams -> (post [T, hc] fp32, comb
    [T, hc, hc] fp32 (Sinkhorn-normalised), collapsed [T, D] = sum_j pre_j x_j in x's dtype).
    fn [(2 + hc) * hc, hc * D], base [(2 + hc) * hc], scale [3]."""
    hc = x.shape[1]
    flat = x.reshape(x.shape[0], -1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + rms_eps)
    mixes = F.linear(flat, fn)
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
    return post, comb, collapsed


def v4_hc_post(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """mHC after a sublayer: stream k becomes post_k * out + sum_j comb[j, k] * x_j.
    x [T, hc, D], out [T, D] -> [T, hc, D] in x's dtype."""
    dt = x.dtype
    return post.to(dt).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), x)


def v4_moe_route(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    tid2eid: torch.Tensor | None,
    input_ids: torch.Tensor,
    top_k: int,
    routed_scaling_factor: float,
    scoring_func: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """V4 routing: scores sqrt(softplus(logit)) (or sigmoid); experts are the top_k of score +
    correction bias, or tid2eid[input_id] for hash-routed layers; weights are the chosen scores
    renormalised to sum 1, times routed_scaling_factor. Returns (weights fp32 [T, k], ids int32
    [T, k]); learned routing lists experts best first."""
    logits = router_logits.float()
    scores = F.softplus(logits).sqrt() if scoring_func == "sqrtsoftplus" else torch.sigmoid(logits)
    if tid2eid is not None:
        ids = tid2eid[input_ids.long()].long()
    else:
        ids = torch.topk(scores + correction_bias.float(), top_k, dim=-1).indices
    wts = scores.gather(1, ids)
    wts = wts / (wts.sum(dim=-1, keepdim=True) + 1e-20) * routed_scaling_factor
    return wts, ids.to(torch.int32)


def v4_moe_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float,
) -> torch.Tensor:
    """Routed experts with V4's clamped SwiGLU: act = silu(min(gate, L)) * clamp(up, -L, L)
    (L <= 0: no clamp). x [T, hidden], w13 [E, 2I, hidden], w2 [E, hidden, I]; computes in
    fp32, returns x's dtype."""

    def act(gate_up: torch.Tensor) -> torch.Tensor:
        inter = gate_up.shape[1] // 2
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        if swiglu_limit > 0:
            gate, up = gate.clamp(max=swiglu_limit), up.clamp(min=-swiglu_limit, max=swiglu_limit)
        return F.silu(gate) * up

    return grouped_experts(x, w13, w2, topk_weights, topk_ids, act).to(x.dtype)
