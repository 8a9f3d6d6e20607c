"""Whole decode steps before/after this round's changes, interleaved in one engine (in process,
1 torch thread): the same running batch steps a few times with the earlier torch-backend code
(per-expert index_add MoE, the whole batch's keys in one attention tile), then a few times with
the current code, and so on, keeping each side's best step and its phase breakdown. On a shared
machine this is the fair comparison; two separate runs minutes apart are not.

    python bench/ab_decode_step.py --model mla512=DIR [-c 8 -c 32] [--rounds 6 --steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ab_moe  # noqa: E402
import decode_breakdown as bd  # noqa: E402


def sides():
    from dsv4_kernels import reference as R

    now = {"moe_experts": R.moe_experts, "DECODE_TILE_BYTES": R.DECODE_TILE_BYTES}
    before = {"moe_experts": ab_moe.loop_experts_any, "DECODE_TILE_BYTES": 1 << 62}

    def use(side: dict) -> None:
        for k, v in side.items():
            setattr(R, k, v)

    return {"before": lambda: use(before), "after": lambda: use(now)}


def measure(model: Path, c: int, rounds: int, steps: int) -> dict:
    from dsv4_engine.step_phases import PHASES

    engine = bd._engine(model, c, 128, rounds * steps * 2 + 8)
    seqs = bd._fill(engine, c, 128, rounds * steps * 2 + 8, seed=0)
    use = sides()
    best: dict = {}
    each: dict = {k: [] for k in use}
    try:
        for r in range(rounds):
            for name in list(use) if r % 2 == 0 else list(reversed(use)):
                use[name]()
                PHASES.enable(True)
                t0 = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                ms = (time.perf_counter() - t0) * 1000 / steps
                each[name].append(round(ms, 2))
                if ms < best.get(name, (1e9,))[0]:
                    best[name] = (ms, PHASES.summary().get("decode"))
                PHASES.enable(False)
    finally:
        use["after"]()
    engine.abort(all_=True)
    engine.step()
    assert all(s.output_ids for s in seqs)
    return {
        "concurrency": c,
        "step_ms_best": {k: round(v[0], 2) for k, v in best.items()},
        "speedup": round(best["before"][0] / best["after"][0], 2),
        "step_ms_each": each,
        "phases_best": {
            k: {p: v["ms_per_step"] for p, v in (b[1] or {}).get("phases", {}).items()} for k, b in best.items()
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", required=True, help="NAME=DIR")
    p.add_argument("-c", "--concurrency", type=int, action="append")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    torch.set_num_threads(1)
    out = {"load_average_start": list(os.getloadavg()), "models": {}}
    for spec in a.model:
        name, _, d = spec.partition("=")
        out["models"][name] = []
        for c in a.concurrency or [8, 32]:
            r = measure(Path(d), c, a.rounds, a.steps)
            out["models"][name].append(r)
            print(name, json.dumps(r))
    out["load_average_end"] = list(os.getloadavg())
    if a.out:
        a.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
