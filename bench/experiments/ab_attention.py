"""A/B of the torch backend's MLA decode at decode shapes, interleaved in one process (best of
N each, 1 torch thread): the whole batch in one tile vs a few requests at a time
(DECODE_TILE_BYTES budgets), checking the outputs are bit for bit the same. With --gathers,
the page gather instead: advanced indexing (`index`, the earlier code) vs index_select over each
page's contiguous run (`runs`, reference.take_pages), at the current tile budget. The cache is
one layer of a page-major pool of --layers layers (strided pages), as the engine's is. With
--native, the torch form (`torch`, reference.mla_decode) vs the native C decode (`native`,
dsv4_kernels.cpu_mla), with the largest difference between their outputs; with --base SRC as
well, that native kernel built from another source of csrc/mla_decode_cpu.c (`base`, e.g. the
previous commit's: `git show HEAD~1:kernels/dsv4_kernels/csrc/mla_decode_cpu.c > /tmp/old.c`),
built with the same flags, interleaved with the other two.

    python -m bench.experiments.ab_attention [-b 8 -b 32] [--dim 576 --v-dim 512 --heads 8 --ctx 160]
    python -m bench.experiments.ab_attention --gathers [-b 8 -b 32]
    python -m bench.experiments.ab_attention --native [-b 1 -b 8 -b 32] [--base OLD.c] [--out FILE]
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
    p.add_argument("--gathers", action="store_true", help="compare the page gathers instead of tile budgets")
    p.add_argument("--native", action="store_true", help="compare the torch form with the native C decode instead")
    p.add_argument("--layers", type=int, default=4, help="layers of the page-major pool the cache is a layer of")
    p.add_argument("--base", help="with --native: also time the native kernel built from this C source")
    p.add_argument("--out", help="also write the JSON here")
    a = p.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    out = {"load_average": list(os.getloadavg()), "shape": vars(a), "results": []}
    budgets = [int(x) for x in a.budgets.split(",")]
    for B in a.batch or [8, 32]:
        width = -(-(a.ctx + 30) // a.page_size)
        pages = B * width + 4
        kv = torch.randn(pages, a.layers, a.page_size, a.dim, generator=g)[:, a.layers // 2]
        q = torch.randn(B, a.heads, a.dim, generator=g)
        lens = torch.randint(a.ctx - 30, a.ctx + 30, (B,), generator=g).int()
        table = torch.randperm(pages, generator=g)[: B * width].view(B, width).int()
        best: dict = {}
        outs: dict = {}
        if a.gathers or a.native:
            r = (_native if a.native else _gathers)(R, q, kv, table, lens, a)
            r["batch"] = B
            out["results"].append(r)
            print(r)
            continue
        keep = R.DECODE_TILE_BYTES
        try:
            for _ in range(a.reps):
                for mib in budgets:
                    R.DECODE_TILE_BYTES = (mib << 20) if mib else 1 << 62
                    t0 = time.thread_time()  # CPU time: a loaded machine's waits for a core left out
                    outs[mib] = R.mla_decode(q, kv, table, lens, 0.1, a.v_dim)
                    best[mib] = min(best.get(mib, 1e9), time.thread_time() - t0)
        finally:
            R.DECODE_TILE_BYTES = keep
        r = {
            "batch": B,
            "cpu_ms_by_tile_mib": {
                ("whole batch" if k == 0 else f"{k} MiB"): round(v * 1e3, 3) for k, v in best.items()
            },
            "bit_equal_to_whole_batch": all(torch.equal(o, outs[budgets[0]]) for o in outs.values()),
        }
        out["results"].append(r)
        print(r)
    out["load_average_end"] = list(os.getloadavg())
    print(json.dumps(out))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


def _native(R, q, kv, table, lens, a) -> dict:
    from dsv4_kernels import cpu_mla

    if not cpu_mla.available():
        raise SystemExit("the native decode is not available here (no C compiler, or turned off)")
    sides = {"torch": R.mla_decode, "native": cpu_mla.mla_decode}
    if a.base:
        sides["base"] = _base_kernel(cpu_mla, a.base)
    best: dict = {}
    outs: dict = {}
    for i in range(a.reps):
        for name in list(sides) if i % 2 == 0 else list(reversed(sides)):
            t0 = time.thread_time()  # CPU time: a loaded machine's waits for a core left out
            outs[name] = sides[name](q, kv, table, lens, 0.1, a.v_dim)
            best[name] = min(best.get(name, 1e9), time.thread_time() - t0)
    r = {
        "cpu_ms": {k: round(v * 1e3, 3) for k, v in best.items()},
        "speedup": round(best["torch"] / best["native"], 2),
        "max_abs_diff": (outs["torch"] - outs["native"]).abs().max().item(),
        "tile_mib": R.DECODE_TILE_BYTES / (1 << 20),
    }
    if a.base:
        r["speedup_over_base"] = round(best["base"] / best["native"], 2)
        r["max_abs_diff_base"] = (outs["torch"] - outs["base"]).abs().max().item()
    return r


def _base_kernel(cpu_mla, src: str):
    """cpu_mla.mla_decode running the kernel built from `src` (same flags and signature)."""
    import ctypes
    from pathlib import Path

    from dsv4_kernels import native

    so = native._build(Path(src), [*native.BASE_FLAGS, *cpu_mla.FLAGS])
    if so is None:
        raise SystemExit(f"{src} did not build")
    lib = ctypes.CDLL(str(so))
    fn = cpu_mla._lib.mla_decode_paged
    lib.mla_decode_paged.argtypes, lib.mla_decode_paged.restype = fn.argtypes, fn.restype

    def run(*args):
        keep = cpu_mla._lib
        cpu_mla._lib = lib
        try:
            return cpu_mla.mla_decode(*args)
        finally:
            cpu_mla._lib = keep

    return run


def _gathers(R, q, kv, table, lens, a) -> dict:
    sides = {"index": lambda cache, pages: cache[pages], "runs": R.take_pages}
    keep = R.take_pages
    best: dict = {}
    outs: dict = {}
    try:
        for i in range(a.reps):
            for name in list(sides) if i % 2 == 0 else list(reversed(sides)):
                R.take_pages = sides[name]
                t0 = time.thread_time()  # CPU time: a loaded machine's waits for a core left out
                outs[name] = R.mla_decode(q, kv, table, lens, 0.1, a.v_dim)
                best[name] = min(best.get(name, 1e9), time.thread_time() - t0)
    finally:
        R.take_pages = keep
    return {
        "cpu_ms_by_gather": {k: round(v * 1e3, 3) for k, v in best.items()},
        "speedup": round(best["index"] / best["runs"], 2),
        "bit_equal": torch.equal(outs["index"], outs["runs"]),
        "tile_mib": R.DECODE_TILE_BYTES / (1 << 20),
    }


if __name__ == "__main__":
    main()
