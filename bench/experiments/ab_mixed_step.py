"""Mixed steps (running decodes + fresh 128-token prompts) with one V3 change off and on,
interleaved in one engine (in process, 1 torch thread, CPU time): `decodes` requests are
decoding when `prefills` fresh prompts arrive; the timed step is the one that prefills them
next to the decodes. Issue 33: at c32 such steps were ~45% of a run's wall. Changes (the
module flag of dsv4_engine.layers.mla each switches):

    mixed_decode       MIXED_DECODE_NATIVE: the step's decodes go to the native decode kernel
    prefill_attention  EXPANDED_BATCHED: the per-head form's lift in one GEMM a weight for all
                       prompts, causal attention in row blocks instead of SDPA per prompt

    python -m bench.experiments.ab_mixed_step --model DIR [--change NAME] [--decodes 24 --prefills 8 --rounds 6] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from bench.suites import decode_breakdown as bd  # noqa: E402

CHANGES = {"mixed_decode": "MIXED_DECODE_NATIVE", "prefill_attention": "EXPANDED_BATCHED"}


def _add(engine, n: int, seed: int, max_tokens: int) -> list:
    from dsv4_engine.sampling_params import SamplingParams
    from dsv4_engine.sequence import Sequence

    prompts = bd.loadgen.random_prompts(n, 128, engine.cfg.vocab_size, seed)
    seqs = [
        Sequence(
            rid=f"mx-{seed}-{i}",
            prompt_ids=p,
            params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        )
        for i, p in enumerate(prompts)
    ]
    for s in seqs:
        engine._add(s)
    return seqs


def measure(model: Path, decodes: int, prefills: int, rounds: int, change: str = "mixed_decode") -> dict:
    from dsv4_engine.layers import mla as V3

    flag = CHANGES[change]

    engine = bd._engine(model, decodes + prefills, 384, 8)  # 384: a 1536-token step budget
    cpu: dict = {"before": [], "after": []}
    tokens: dict = {}
    for r in range(rounds + 1):
        for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
            setattr(V3, flag, name == "after")
            running = _add(engine, decodes, 2000 + r, 8)
            while any(not s.output_ids for s in running):
                engine.step()
            engine.step()  # all of them decoding now
            fresh = _add(engine, prefills, 3000 + r, 2)
            c0 = time.thread_time()
            engine.step()
            ms = (time.thread_time() - c0) * 1000
            assert all(s.output_ids for s in fresh), "the fresh prompts did not prefill in one step"
            if r > 0:  # round 0 warms up
                cpu[name].append(round(ms, 1))
            tokens.setdefault(r, {})[name] = [s.output_ids[:2] for s in running + fresh]
            while engine.scheduler.has_work():
                engine.step()
            tokens[r][name] += [s.output_ids for s in running + fresh]
    setattr(V3, flag, True)
    return {
        "change": change,
        "flag": flag,
        "decodes": decodes,
        "prefills": prefills,
        "prompt_len": 128,
        "mixed_step_cpu_ms_best": {k: min(v) for k, v in cpu.items()},
        "mixed_step_cpu_speedup": round(min(cpu["before"]) / min(cpu["after"]), 2),
        "mixed_step_cpu_ms_each": cpu,
        "tokens_identical": all(t["before"] == t["after"] for t in tokens.values()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--change", choices=sorted(CHANGES), default="mixed_decode")
    p.add_argument("--decodes", type=int, default=24)
    p.add_argument("--prefills", type=int, default=8)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--out")
    a = p.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()
    r = {"model": a.model, "torch_threads": 1, **measure(Path(a.model), a.decodes, a.prefills, a.rounds, a.change)}
    r["loadavg_before_after"] = [round(x, 2) for x in (*load, *os.getloadavg())]
    text = json.dumps(r, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
