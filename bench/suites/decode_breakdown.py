"""The decode step's breakdown by phase (dsv4_engine.step_phases) and its top torch ops, for a
few models and concurrencies, in one process: an in-process Engine (no HTTP), `c` requests
prefilled, then decode steps of the whole batch, best of N rounds (the machine is shared: the
least disturbed round is the closest to the code's own cost).

    python -m bench.suites.decode_breakdown --model mla512=/path --model v4-tiny=/path [-c 8 -c 32]
        [--steps 24] [--rounds 3] [--ops] [--out bench/results/decode_breakdown.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Optional

from bench.harness import loadgen


def _engine(model: Path, c: int, prompt_len: int, steps: int):
    from dsv4_engine.engine import Engine
    from dsv4_engine.engine_args import EngineArgs

    pages = (c + 4) * (-(-(prompt_len + steps * 2 + 16) // 16)) + 16
    return Engine(
        EngineArgs(
            model=str(model),
            dtype="float32",
            kv_pages=pages,
            max_num_seqs=c + 4,
            max_num_batched_tokens=max(1024, prompt_len * 4),
            enable_prefix_cache=False,
        )
    )


def _fill(engine, c: int, prompt_len: int, new_tokens: int, seed: int) -> list:
    from dsv4_engine.sampling_params import SamplingParams
    from dsv4_engine.sequence import Sequence

    prompts = loadgen.random_prompts(c, prompt_len, engine.cfg.vocab_size, seed)
    seqs = [
        Sequence(
            rid=f"bd-{seed}-{i}",
            prompt_ids=p,
            params=SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True),
        )
        for i, p in enumerate(prompts)
    ]
    for s in seqs:
        engine._add(s)
    while any(not s.output_ids for s in seqs):
        engine.step()
    return seqs


def measure(model: Path, c: int, prompt_len: int, steps: int, rounds: int, ops: bool) -> dict:
    import torch

    from dsv4_engine.step_phases import PHASES

    engine = _engine(model, c, prompt_len, steps)
    _fill(engine, min(c, 4), prompt_len, 4, seed=99)  # warm-up: first-call allocations
    while engine.scheduler.has_work():
        engine.step()
    best: Optional[dict] = None
    walls, cpus, faults = [], [], []
    for r in range(rounds):
        seqs = _fill(engine, c, prompt_len, steps + 2, seed=r)
        PHASES.enable(True, engine.runner.device)
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - t0
        cpus.append(round((time.thread_time() - c0) * 1000 / steps, 3))
        faults.append(round((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / steps, 1))
        summary = PHASES.summary()
        PHASES.enable(False)
        walls.append(round(wall * 1000 / steps, 3))
        if r == 0:  # the same prompts in every run: greedy tokens comparable across commits
            head = [s.output_ids[:8] for s in seqs[:2]]
        if best is None or wall < best["wall"]:
            best = {"wall": wall, "phases": summary.get("decode")}
        engine.abort(all_=True)
        engine.step()
    out = {
        "concurrency": c,
        "prompt_len": prompt_len,
        "decode_steps": steps,
        "rounds": rounds,
        "step_ms_each_round": walls,
        "step_ms_best": min(walls),
        # the stepping thread's CPU time (torch runs on it with 1 thread): the step's own cost
        # without a loaded machine's waits for a core; and page faults per step
        "step_cpu_ms_each_round": cpus,
        "step_cpu_ms_best": min(cpus),
        "minor_faults_per_step_each_round": faults,
        "tok_s_best": round(c * 1000 / min(walls), 1),
        "breakdown_best_round": best["phases"],
        "greedy_head_round0": head,
    }
    if ops:
        from torch.profiler import ProfilerActivity, profile

        _fill(engine, c, prompt_len, steps + 2, seed=7)
        with profile(activities=[ProfilerActivity.CPU]) as tp:
            for _ in range(steps):
                engine.step()
        ev = tp.key_averages()
        total = sum(e.self_cpu_time_total for e in ev) or 1
        rows = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:15]
        out["torch_ops_per_step"] = round(sum(e.count for e in ev if e.key.startswith("aten::")) / steps, 1)
        out["top_ops"] = [
            {
                "op": e.key,
                "self_cpu_ms_per_step": round(e.self_cpu_time_total / 1000 / steps, 3),
                "share": round(e.self_cpu_time_total / total, 3),
                "calls_per_step": round(e.count / steps, 1),
            }
            for e in rows
        ]
        engine.abort(all_=True)
        engine.step()
    out["torch_threads"] = torch.get_num_threads()
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", required=True, help="NAME=DIR")
    p.add_argument("-c", "--concurrency", type=int, action="append")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ops", action="store_true", help="also torch.profiler's top ops of the decode steps")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: what `dsv4 serve` uses on a 2-CPU machine, engine_core.cpu_threads)",
    )
    p.add_argument("--label", default="")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    result = {"label": a.label, "load_average_start": list(os.getloadavg()), "models": {}}
    for spec in a.model:
        name, _, d = spec.partition("=")
        result["models"][name] = [
            measure(Path(d), c, a.prompt_len, a.steps, a.rounds, a.ops) for c in (a.concurrency or [8, 32])
        ]
    result["load_average_end"] = list(os.getloadavg())
    text = json.dumps(result, indent=1)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    for name, runs in result["models"].items():
        for r in runs:
            ph = (r["breakdown_best_round"] or {}).get("phases", {})
            print(
                f"{name} c{r['concurrency']}: step {r['step_ms_best']} ms (rounds {r['step_ms_each_round']}) "
                + " ".join(f"{k}={v['ms_per_step']}" for k, v in ph.items())
            )
            for o in r.get("top_ops", [])[:10]:
                print(f"    {o['op']:40s} {o['self_cpu_ms_per_step']:8.3f} ms {o['calls_per_step']:7.1f}/step")
    print("load", result["load_average_start"], "->", result["load_average_end"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
