"""A/B of the routed-experts function at decode shapes, interleaved in one process (best of N
each, 1 torch thread): the per-expert index_add loop the torch backend had vs the grouped
computation (dsv4_kernels.grouped_moe) vs the native call (dsv4_kernels.cpu_moe; with
--shared also the shared expert: torch's grouped + F.linear SwiGLU vs one native call). On a shared machine the interleaving and best-of keep
the comparison fair where two separate runs are not. --against REV adds the native kernel as
csrc/cpu_moe.c was at git revision REV (built under another name), for old-vs-new kernel A/Bs;
it runs on its own copy of the weights in 4 KB pages (the new side's get 2 MB pages, as the engine's do:
dsv4_kernels.huge_pages).

    python -m bench.experiments.ab_moe [--hidden 512 --inter 256 --experts 8 --top-k 2] [-t 8 -t 32] [--against REV]
"""

from __future__ import annotations

import argparse
import json
import ctypes
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dsv4_kernels import cpu_moe, huge_pages, native
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


def old_library(rev: str) -> ctypes.CDLL:
    """cpu_moe.c at git revision `rev`, built with the current flags and loaded under its own
    name (a drop-in for cpu_moe._lib)."""
    src = subprocess.run(
        ["git", "show", f"{rev}:kernels/dsv4_kernels/csrc/cpu_moe.c"], check=True, capture_output=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "cpu_moe_old.c"
    path.write_bytes(src)
    so = native._build(path, [*native.BASE_FLAGS, "-march=native"])
    assert so is not None, "the old kernel did not build"
    lib = ctypes.CDLL(str(so))
    lib.cpu_moe.argtypes = [native.P, native.I64, native.I64, native.P, native.P, native.I64, native.P, native.P]
    lib.cpu_moe.argtypes += [native.I64, native.I64, native.P, native.P, native.I64, native.F32, native.P]
    return lib


def old_kernel(rev: str):
    """A function with cpu_moe.experts' arguments that runs the kernel of git revision `rev`."""
    lib = old_library(rev)

    def run(x, w13, w2, wts, ids, sh):
        new = cpu_moe._lib
        cpu_moe._lib = lib  # the same Python wrapper around the old library
        try:
            return cpu_moe.experts(x, w13, w2, wts, ids, sh)
        finally:
            cpu_moe._lib = new

    return run


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
    p.add_argument("--against", help="also time the native kernel of this git revision (native_old)")
    p.add_argument("--native-only", action="store_true", help="skip the torch sides (loop, grouped)")
    a = p.parse_args()
    torch.set_num_threads(1)
    old = old_kernel(a.against) if a.against else None
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
        # the weights on 2 MB pages, as the engine keeps them (the old kernel's copy below is not)
        huge_pages.advise_all([w for w13, w2, sh in layers for w in (w13, w2, *(sh or ()))])
        ids = torch.stack([torch.randperm(a.experts, generator=g)[: a.top_k] for _ in range(t)]).int()
        wts = torch.rand(t, a.top_k, generator=g)
        w13, w2, sh = layers[0]
        same = torch.equal(loop_experts(x, w13, w2, wts, ids), grouped_experts(x, w13, w2, wts, ids, silu_mul))

        def with_shared(out, sh):
            return out if sh is None else out + F.linear(silu_mul(F.linear(x, sh[0])), sh[1])

        def over_layers(one):
            return lambda: [one(*layer) for layer in layers][0]

        sides = {}
        if not a.native_only:
            sides["loop"] = over_layers(lambda w13, w2, sh: with_shared(loop_experts(x, w13, w2, wts, ids), sh))
            sides["grouped"] = over_layers(
                lambda w13, w2, sh: with_shared(grouped_experts(x, w13, w2, wts, ids, silu_mul), sh)
            )
        if cpu_moe.available():
            sides["native"] = over_layers(lambda w13, w2, sh: cpu_moe.experts(x, w13, w2, wts, ids, sh))
            if old is not None:  # on its own copy of the weights (4 KB pages: the new side's become 2 MB)
                mine = [
                    (a.clone(), b.clone(), None if c is None else (c[0].clone(), c[1].clone())) for a, b, c in layers
                ]
                sides["native_old"] = lambda: [old(x, *layer[:2], wts, ids, layer[2]) for layer in mine][0]
        clock = time.thread_time if a.cpu_time else time.perf_counter
        best = {k: 1e9 for k in sides}
        for _ in range(a.reps):
            for name, fn in sides.items():
                t0 = clock()
                fn()
                best[name] = min(best[name], (clock() - t0) / a.layers)
        r = {"tokens": t, "bit_equal": same, **{f"{k}_ms": round(v * 1e3, 3) for k, v in best.items()}}
        if "loop" in sides:
            r["speedup"] = round(best["loop"] / best["grouped"], 2)
        if "native" in sides:
            ref = with_shared(grouped_experts(x, w13, w2, wts, ids, silu_mul), sh)
            if "grouped" in sides:
                r["native_vs_grouped"] = round(best["grouped"] / best["native"], 2)
            r["native_max_abs_diff"] = float((sides["native"]() - ref).abs().max())
        if "native_old" in sides:
            r["native_vs_old"] = round(best["native_old"] / best["native"], 2)
            r["native_old_max_abs_diff"] = float((sides["native_old"]() - ref).abs().max())
        out["results"].append(r)
        print(r)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
