"""The V3 decode step's RMSNorms and ropes alone, torch form vs native (dsv4_kernels.cpu_rmsnorm,
dsv4_kernels.cpu_rope), at mla512's shapes: per step 8 norms with the residual add over hidden,
4 over q_lora, 4 over the kv_a latent (a strided slice), the final norm, 4 query ropes [T, H, R]
and 4 key ropes [T, 1, R]. Thread CPU time per step, interleaved, best of N (1 torch thread).

    python -m bench.experiments.ab_norm_rope [-c 1 -c 8 -c 32] [--rounds 50] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from dsv4_kernels import cpu_rmsnorm, cpu_rope
from dsv4_kernels import reference as ref

HIDDEN, Q_LORA, C, R, H, NOPE = 512, 128, 512, 64, 8, 128


def step(T: int, norm, rope, t: dict) -> None:
    res = t["res"]
    for _ in range(4):
        _, res = norm(t["x"], t["w_h"], 1e-6, res)
        norm(t["qa"], t["w_q"], 1e-6)
        norm(t["ckv"][:, :C], t["w_c"], 1e-6)
        rope(t["q"][:, :, NOPE:], t["pos"], t["cos"], t["sin"])
        rope(t["ckv"][:, C:].unsqueeze(1), t["pos"], t["cos"], t["sin"])
        _, res = norm(t["x"], t["w_h"], 1e-6, res)
    norm(t["x"] + res, t["w_h"], 1e-6)


def measure(T: int, rounds: int) -> dict:
    g = torch.Generator().manual_seed(T)
    freqs = torch.outer(torch.arange(4096, dtype=torch.float32), torch.rand(R // 2, generator=g))
    t = {
        "x": torch.randn(T, HIDDEN, generator=g),
        "res": torch.randn(T, HIDDEN, generator=g),
        "qa": torch.randn(T, Q_LORA, generator=g),
        "ckv": torch.randn(T, C + R, generator=g),
        "q": torch.randn(T, H, NOPE + R, generator=g),
        "pos": torch.randint(0, 4096, (T,), generator=g),
        "cos": freqs.cos(),
        "sin": freqs.sin(),
        "w_h": torch.randn(HIDDEN, generator=g),
        "w_q": torch.randn(Q_LORA, generator=g),
        "w_c": torch.randn(C, generator=g),
    }
    sides = {
        "torch": (ref.rmsnorm, ref.rope_interleaved_),
        "native": (cpu_rmsnorm.rmsnorm, cpu_rope.rope_interleaved_),
    }
    best = {k: 1e9 for k in sides}
    for r in range(rounds):
        for name in sides if r % 2 == 0 else reversed(list(sides)):
            c0 = time.thread_time()
            for _ in range(5):
                step(T, *sides[name], t)
            best[name] = min(best[name], (time.thread_time() - c0) * 1000 / 5)
    return {
        "tokens": T,
        "step_cpu_ms_best": {k: round(v, 4) for k, v in best.items()},
        "saved_ms_per_step": round(best["torch"] - best["native"], 4),
        "speedup": round(best["torch"] / best["native"], 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-c", "--concurrency", type=int, action="append")
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    torch.set_num_threads(1)
    assert cpu_rmsnorm.available() and cpu_rope.available(), "no native build here"
    out = {"load_average_start": list(os.getloadavg()), "runs": []}
    for c in a.concurrency or [1, 8, 32]:
        r = measure(c, a.rounds)
        out["runs"].append(r)
        print(json.dumps(r))
    out["load_average_end"] = list(os.getloadavg())
    if a.out:
        a.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
