"""A/B of the torch backend's MLA decode at decode shapes, interleaved in one process (best of
N each, 1 torch thread): the whole batch in one tile vs a few requests at a time
(DECODE_TILE_BYTES budgets), checking the outputs are bit for bit the same.

    python bench/ab_attention.py [-b 8 -b 32] [--dim 576 --v-dim 512 --heads 8 --ctx 160]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from dsv4_kernels import reference as R


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-b", "--batch", type=int, action="append")
    p.add_argument("--dim", type=int, default=576)
    p.add_argument("--v-dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ctx", type=int, default=160, help="mean context (tokens), +-30")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--budgets", default="0,1,2,4,8", help="DECODE_TILE_BYTES in MiB; 0 = the whole batch at once")
    a = p.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    out = {"load_average": list(os.getloadavg()), "shape": vars(a), "results": []}
    budgets = [int(x) for x in a.budgets.split(",")]
    for B in a.batch or [8, 32]:
        width = -(-(a.ctx + 30) // a.page_size)
        pages = B * width + 4
        kv = torch.randn(pages, a.page_size, a.dim, generator=g)
        q = torch.randn(B, a.heads, a.dim, generator=g)
        lens = torch.randint(a.ctx - 30, a.ctx + 30, (B,), generator=g).int()
        table = torch.randperm(pages, generator=g)[: B * width].view(B, width).int()
        best: dict = {}
        outs: dict = {}
        keep = R.DECODE_TILE_BYTES
        try:
            for _ in range(a.reps):
                for mib in budgets:
                    R.DECODE_TILE_BYTES = (mib << 20) if mib else 1 << 62
                    t0 = time.perf_counter()
                    outs[mib] = R.mla_decode(q, kv, table, lens, 0.1, a.v_dim)
                    best[mib] = min(best.get(mib, 1e9), time.perf_counter() - t0)
        finally:
            R.DECODE_TILE_BYTES = keep
        r = {
            "batch": B,
            "ms_by_tile_mib": {("whole batch" if k == 0 else f"{k} MiB"): round(v * 1e3, 3) for k, v in best.items()},
            "bit_equal_to_whole_batch": all(torch.equal(o, outs[budgets[0]]) for o in outs.values()),
        }
        out["results"].append(r)
        print(r)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
