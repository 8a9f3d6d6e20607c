"""A/B of the routed-experts function at decode shapes, interleaved in one process (best of N
each, 1 torch thread): the per-expert index_add loop the torch backend had vs the grouped
computation (dsv4_kernels.grouped_moe) vs the native call (dsv4_kernels.cpu_moe; with
--shared also the shared expert: torch's grouped + F.linear SwiGLU vs one native call). On a shared machine the interleaving and best-of keep
the comparison fair where two separate runs are not.

    python bench/ab_moe.py [--hidden 512 --inter 256 --experts 8 --top-k 2] [-t 8 -t 32]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from dsv4_kernels import cpu_moe
from dsv4_kernels.grouped_moe import grouped_experts


def loop_experts(x, w13, w2, topk_weights, topk_ids):
    """The torch backend's moe_experts before the grouped form (kept here as the baseline)."""
    num_tokens, hidden = x.shape
    inter = w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32)
    flat_ids = topk_ids.reshape(-1).to(torch.long)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    flat_weights = topk_weights.reshape(-1).float()[order]
    tokens_sorted = order // top_k
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = tokens_sorted[start : start + count]
        gate_up = x.index_select(0, tokens).float() @ w13[expert].float().t()
        ys = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ w2[expert].float().t()
        out.index_add_(0, tokens, ys * flat_weights[start : start + count, None])
        start += count
    return out


def loop_experts_any(x, w13, w2, topk_weights, topk_ids):
    """loop_experts in x's dtype (a drop-in for the torch backend's moe_experts)."""
    return loop_experts(x, w13, w2, topk_weights, topk_ids).to(x.dtype)


def silu_mul(g):
    i = g.shape[1] // 2
    return F.silu(g[:, :i]) * g[:, i:]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("-t", "--tokens", type=int, action="append")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--shared", type=int, default=0, help="shared expert width (0: none)")
    p.add_argument("--cpu-time", action="store_true", help="time the thread's CPU, not the wall")
    p.add_argument("--layers", type=int, default=1, help="distinct weight sets per timing (12: from DRAM)")
    a = p.parse_args()
    torch.set_num_threads(1)
    out = {"load_average": list(os.getloadavg()), "shape": vars(a), "results": []}
    for t in a.tokens or [8, 32]:
        g = torch.Generator().manual_seed(t)
        x = torch.randn(t, a.hidden, generator=g)
        # --layers N: N distinct weight sets, every timing runs all N and divides: with N sets
        # past the last-level cache each call reads its weights from DRAM, as an engine step does
        layers = []
        for _ in range(a.layers):
            w13 = torch.randn(a.experts, 2 * a.inter, a.hidden, generator=g) * 0.05
            w2 = torch.randn(a.experts, a.hidden, a.inter, generator=g) * 0.05
            sh = None
            if a.shared:
                sh = (
                    torch.randn(2 * a.shared, a.hidden, generator=g) * 0.05,
                    torch.randn(a.hidden, a.shared, generator=g) * 0.05,
                )
            layers.append((w13, w2, sh))
        ids = torch.stack([torch.randperm(a.experts, generator=g)[: a.top_k] for _ in range(t)]).int()
        wts = torch.rand(t, a.top_k, generator=g)
        w13, w2, sh = layers[0]
        same = torch.equal(loop_experts(x, w13, w2, wts, ids), grouped_experts(x, w13, w2, wts, ids, silu_mul))

        def with_shared(out, sh):
            return out if sh is None else out + F.linear(silu_mul(F.linear(x, sh[0])), sh[1])

        def over_layers(one):
            return lambda: [one(*layer) for layer in layers][0]

        sides = {
            "loop": over_layers(lambda w13, w2, sh: with_shared(loop_experts(x, w13, w2, wts, ids), sh)),
            "grouped": over_layers(
                lambda w13, w2, sh: with_shared(grouped_experts(x, w13, w2, wts, ids, silu_mul), sh)
            ),
        }
        if cpu_moe.available():
            sides["native"] = over_layers(lambda w13, w2, sh: cpu_moe.experts(x, w13, w2, wts, ids, sh))
        clock = time.thread_time if a.cpu_time else time.perf_counter
        best = {k: 1e9 for k in sides}
        for _ in range(a.reps):
            for name, fn in sides.items():
                t0 = clock()
                fn()
                best[name] = min(best[name], (clock() - t0) / a.layers)
        r = {
            "tokens": t,
            "bit_equal": same,
            **{f"{k}_ms": round(v * 1e3, 3) for k, v in best.items()},
            "speedup": round(best["loop"] / best["grouped"], 2),
        }
        if "native" in sides:
            r["native_vs_grouped"] = round(best["grouped"] / best["native"], 2)
            r["native_max_abs_diff"] = float((sides["native"]() - sides["grouped"]()).abs().max())
        out["results"].append(r)
        print(r)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
