"""Routed experts as a grouped computation over the (token, k) pairs sorted by expert: the
torch backend's MoE (V3 and V4 references) and the V4 model's own torch path share it. Pure torch;
the CPU backend hands in its native passes (`passes`: dsv4_kernels.cpu_grouped_moe)."""

from __future__ import annotations

from typing import Any, Optional

import torch


def grouped_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act,
    dtype: torch.dtype = torch.float32,
    add: Optional[torch.Tensor] = None,
    passes: Any = None,
) -> torch.Tensor:
    """Routed experts over the (token, k) pairs sorted by expert, in `dtype`: one gather of the
    pairs' rows, one matmul pair per expert that received tokens (written into slices of one
    buffer), one activation `act(gate_up) -> [P, I]` and one weighting over all pairs, and one
    gather back to (token, k) order summed over k. Returns [T, hidden] in `dtype`.

    Each expert multiplies exactly the rows it did in a per-expert loop, so every pair's result
    is the same; the k results of a token are summed once instead of index_add'ed expert by
    expert (index_add_ on CPU is slow, and parallel it waits on every thread). With top-2 the
    sum is bit-for-bit the loop's (0 + a + b == b + a). Pairs whose id is outside [0, E) (-1:
    another rank's expert under tensor parallelism) add nothing and cost nothing. `add` [T,
    hidden] (the shared expert's output) is added after the sum, as `out + add` would.

    With `passes` (the CPU backend's dsv4_kernels.cpu_grouped_moe), fp32 on the CPU the gather
    runs as a native copy, and with top-k <= 4 the weighting + sum + add as one native pass in
    torch's order (torch sums up to 4 rows in order from 0; more in an order of its own), so the
    result is the same bits.
    """
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts = w13.shape[0]
    flat_ids = topk_ids.reshape(-1).to(torch.long)
    flat_ids = torch.where((flat_ids >= 0) & (flat_ids < num_experts), flat_ids, num_experts)
    order = torch.argsort(flat_ids, stable=True)  # pairs by expert; within one, in (token, k) order
    counts = torch.bincount(flat_ids, minlength=num_experts + 1).tolist()
    live = num_tokens * top_k - counts[num_experts]
    cpu_grouped_moe = passes
    native = passes is not None and dtype == torch.float32 and x.stride(1) == 1
    native = native and cpu_grouped_moe.supports(x, w13, w2, topk_weights) and (add is None or passes.supports(add))
    rows = order[:live] // top_k
    if native:  # intermediates in reused scratch (cpu_grouped_moe: fresh pages cost more than the copies)
        xs = cpu_grouped_moe.gather_rows(x, rows, cpu_grouped_moe.scratch("moe_xs", live, hidden))
        gate_up = cpu_grouped_moe.scratch("moe_gate_up", live, w13.shape[1])
    else:
        xs = x.index_select(0, rows).to(dtype)
        gate_up = torch.empty(live, w13.shape[1], dtype=dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts[:num_experts]):
        if count:
            torch.mm(xs[start : start + count], w13[expert].to(dtype).t(), out=gate_up[start : start + count])
            start += count
    h = act(gate_up)
    if native:
        ys = cpu_grouped_moe.scratch("moe_ys", num_tokens * top_k, hidden)
    else:
        ys = torch.empty(num_tokens * top_k, hidden, dtype=dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts[:num_experts]):
        if count:
            torch.mm(h[start : start + count], w2[expert].to(dtype).t(), out=ys[start : start + count])
            start += count
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    if native and top_k <= 4:  # one pass: each token's k weighted rows summed in k order (+ add)
        pos = torch.where(back < live, back, -1).view(num_tokens, top_k)
        return cpu_grouped_moe.combine(ys, pos, topk_weights.contiguous(), add)
    ys[live:].zero_()
    ys[:live].mul_(topk_weights.reshape(-1)[order[:live]].to(dtype)[:, None])
    out = ys.index_select(0, back).view(num_tokens, top_k, hidden).sum(dim=1)
    return out if add is None else out + add
