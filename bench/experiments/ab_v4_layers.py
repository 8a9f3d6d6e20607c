"""DeepSeek-V4 before/after a refactor that must not change the math (issue 40's layers): greedy
tokens of a fixed mixed workload (8 requests, prompts 3-40 tokens, 24 new tokens each, prefill and
decode sharing steps) and decode throughput, best of N runs, with 1 torch thread. Run it once per
tree (PYTHONPATH pointing at the tree) and compare the JSON files; `--compare A B` prints whether
the tokens are identical and the throughput ratio.

    PYTHONPATH=<tree paths> python -m bench.experiments.ab_v4_layers --model DIR --out after.json
    python -m bench.experiments.ab_v4_layers --compare before.json after.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

LENS = [5, 9, 17, 33, 40, 12, 3, 25]
NEW = 24


def run(model: str) -> tuple[dict, float, float]:
    """(tokens by request, tokens per wall second, tokens per CPU second) of one pass."""
    from dsv4_engine.engine import Engine
    from dsv4_engine.engine_args import EngineArgs
    from dsv4_engine.sampling_params import SamplingParams
    from dsv4_engine.sequence import Sequence, SeqStatus

    e = Engine(EngineArgs(model=model, device="cpu", kv_pages=256, page_size=4, max_num_seqs=8))
    prompts = [[(7 * i + 3 * k) % 200 + 1 for k in range(n)] for i, n in enumerate(LENS)]
    seqs = [
        Sequence(f"r{i}", p, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    for s in seqs:
        e.submit(s)
    wall, cpu = time.perf_counter(), time.process_time()
    while any(s.status != SeqStatus.FINISHED for s in seqs):
        e.step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    n = sum(len(s.output_ids) for s in seqs)
    return {s.rid: list(s.output_ids) for s in seqs}, n / wall, n / cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2)
    a = ap.parse_args()
    if a.compare:
        x, y = (json.load(open(p)) for p in a.compare)
        print(
            json.dumps(
                {
                    "tokens_identical": x["tokens"] == y["tokens"],
                    "wall_ratio": round(y["tok_s_wall"] / x["tok_s_wall"], 3),
                    "cpu_ratio": round(y["tok_s_cpu"] / x["tok_s_cpu"], 3),
                }
            )
        )
        return
    torch.set_num_threads(1)
    runs = [run(a.model) for _ in range(a.runs)]
    out = {
        "tokens": runs[0][0],
        "same_every_run": all(r[0] == runs[0][0] for r in runs),
        "tok_s_wall": round(max(r[1] for r in runs), 2),
        "tok_s_cpu": round(max(r[2] for r in runs), 2),
    }
    print(json.dumps({k: v for k, v in out.items() if k != "tokens"}))
    if a.out:
        json.dump(out, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
