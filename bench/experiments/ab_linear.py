"""A decode step's dense projections, F.linear (MKL) vs the native loop (dsv4_kernels.cpu_moe.linear),
with the weights cold in memory as in a step (which streams more weights than the L3 holds):
each round cycles once through ~90 MB of distinct weights of the mla512 shapes on 2 MB pages,
both sides interleaved in one process (1 torch thread), each call timed on the thread's CPU
clock; per shape and token count the best round's mean call and the weight bytes it read a second.

    python -m bench.experiments.ab_linear [--tokens 1 8 16 32 64] [--rounds 7] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dsv4_kernels import cpu_moe, huge_pages

# mla512's projections: q_b / kv_a [576, 512], o / q_a [512, 512], the dense MLP's up [1024, ...]
# and the lm_head / gate sizes [512, 128], [1024, 128]
SHAPES = [(576, 512), (512, 512), (1024, 128), (512, 128)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 48, 64])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--copies", type=int, default=32, help="distinct weights of each shape")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    torch.set_num_threads(1)
    assert cpu_moe.available()
    bufs = [torch.randn(a.copies, n, k) / k**0.5 for n, k in SHAPES]
    huge_pages.advise_all(bufs)
    total = sum(b.numel() * 4 for b in bufs)
    order = [(s, i) for i in range(a.copies) for s in range(len(SHAPES))]  # shapes interleaved
    sides = {"torch": F.linear, "native": cpu_moe.linear}
    load0 = list(os.getloadavg())
    res = []
    with torch.inference_mode():
        for T in a.tokens:
            xs = [torch.randn(T, k) for _, k in SHAPES]
            best = {name: [float("inf")] * len(SHAPES) for name in sides}
            for r in range(a.rounds):
                for name in list(sides) if r % 2 == 0 else list(reversed(sides)):
                    fn = sides[name]
                    ns = [0] * len(SHAPES)
                    for s, i in order:
                        t0 = time.thread_time_ns()
                        fn(xs[s], bufs[s][i])
                        ns[s] += time.thread_time_ns() - t0
                    best[name] = [min(b, v) for b, v in zip(best[name], ns)]
            for s, (n, k) in enumerate(SHAPES):
                us = {name: best[name][s] / a.copies / 1e3 for name in sides}
                row = {
                    "tokens": T,
                    "shape": [n, k],
                    "us_per_call": {name: round(v, 2) for name, v in us.items()},
                    "weight_GBps": {name: round(n * k * 4 / v / 1e3, 2) for name, v in us.items()},
                    "speedup": round(us["torch"] / us["native"], 2),
                }
                res.append(row)
                print(json.dumps(row))
    out = {
        "what": "y = x W^T, weights cold (cycling through distinct ones on 2 MB pages), thread CPU time, best round",
        "weights_MB_cycled": round(total / 2**20, 1),
        "rounds": a.rounds,
        "load_average_start": load0,
        "load_average_end": list(os.getloadavg()),
        "results": res,
    }
    if a.out:
        a.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
