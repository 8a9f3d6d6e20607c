"""Routed experts as a grouped computation over the (token, k) pairs sorted by expert: the
torch backend's MoE (V3 and V4 references) and the V4 model's own torch path share it."""

from __future__ import annotations

import torch


def grouped_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Routed experts over the (token, k) pairs sorted by expert, in `dtype`: one gather of the
    pairs' rows, one matmul pair per expert that received tokens (written into slices of one
    buffer), one activation `act(gate_up) -> [P, I]` and one weighting over all pairs, and one
    gather back to (token, k) order summed over k. Returns [T, hidden] in `dtype`.

    Each expert multiplies exactly the rows it did in a per-expert loop, so every pair's result
    is the same; the k results of a token are summed once instead of index_add'ed expert by
    expert (index_add_ on CPU is slow, and parallel it waits on every thread). With top-2 the
    sum is bit-for-bit the loop's (0 + a + b == b + a). Pairs whose id is outside [0, E) (-1:
    another rank's expert under tensor parallelism) add nothing and cost nothing.
    """
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts = w13.shape[0]
    flat_ids = topk_ids.reshape(-1).to(torch.long)
    flat_ids = torch.where((flat_ids >= 0) & (flat_ids < num_experts), flat_ids, num_experts)
    order = torch.argsort(flat_ids, stable=True)  # pairs by expert; within one, in (token, k) order
    counts = torch.bincount(flat_ids, minlength=num_experts + 1).tolist()
    live = num_tokens * top_k - counts[num_experts]
    xs = x.index_select(0, order[:live] // top_k).to(dtype)
    gate_up = torch.empty(live, w13.shape[1], dtype=dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts[:num_experts]):
        if count:
            torch.mm(xs[start : start + count], w13[expert].to(dtype).t(), out=gate_up[start : start + count])
            start += count
    h = act(gate_up)
    ys = torch.empty(num_tokens * top_k, hidden, dtype=dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts[:num_experts]):
        if count:
            torch.mm(h[start : start + count], w2[expert].to(dtype).t(), out=ys[start : start + count])
            start += count
    ys[live:].zero_()
    ys[:live].mul_(topk_weights.reshape(-1)[order[:live]].to(dtype)[:, None])
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return ys.index_select(0, back).view(num_tokens, top_k, hidden).sum(dim=1)
