"""CPU time of the engine's per-step work around the forward, in process (issue 33): the gauges
and the hand-off run after every step (`Engine.update_gauges`, the core's `flush` with one
output row per running request), and the per-token bookkeeping (`Engine._append_token`: metrics,
stop checks, the output to the sink) for `-c` requests. Thread CPU time, best of --rounds, so a
loaded machine's waits for a core do not count.

    python -m bench.experiments.engine_overhead --model DIR [-c 32] [--iters 2000] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import time

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence


def best_us(fn, iters: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.thread_time()
        for _ in range(iters):
            fn()
        best = min(best, (time.thread_time() - t) / iters)
    return best * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("-c", type=int, default=32)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--label", default="")
    p.add_argument("--out")
    a = p.parse_args()
    engine = Engine(EngineArgs(model=a.model, device="cpu", kernel_backend="cpu", kv_pages=256, page_size=16))
    engine.detokenize = False  # as in `dsv4 serve`'s core: text is the HTTP process's
    outs: list = []
    seqs = []
    for k in range(a.c):
        s = Sequence(rid=f"r{k}", prompt_ids=[3, 4, 5], params=SamplingParams(max_tokens=10**9, ignore_eos=True))
        s.sink = outs.append
        seqs.append(s)
    engine.update_gauges()

    def tokens() -> None:
        for s in seqs:
            engine._append_token(s, 7)
        outs.clear()
        for s in seqs:  # keep the sequences short: the figure is per token, not per context length
            del s.output_ids[:]

    res = {
        "label": a.label,
        "model": os.path.basename(a.model.rstrip("/")),
        "c": a.c,
        "update_gauges_us_per_step": round(best_us(engine.update_gauges, a.iters, a.rounds), 2),
        "append_token_us_per_token": round(best_us(tokens, a.iters // 10, a.rounds) / a.c, 2),
        "load_average": os.getloadavg(),
    }
    print(json.dumps(res))
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
