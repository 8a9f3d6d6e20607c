"""DeepSeek-V4 whole decode steps with one change of issue 33 off and on, interleaved in one engine
(in process, 1 torch thread, as bench/experiments/ab_decode_step.py does for mla512): the same running batch
steps a few times with the change off, then on, alternating, keeping each side's best step and
its phase breakdown (in the loop thread's CPU time), and the process's CPU time per step (1 torch thread: on a loaded machine
this is the code's own cost, where wall time also holds the waits for a core); the torch op count per step of each side from torch.profiler. Each change
is a switch on the model object, so "off" is the code as it was before that commit.

    python -m bench.experiments.ab_v4_step --model v4-tiny=DIR --change native_mhc [-c 8 -c 32]
        [--rounds 6 --steps 3] [--prefill] [--out FILE]

--prefill times the prefill of c fresh 128-token prompts instead (the change off and on in
alternating rounds, CPU time, first tokens compared).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from bench.suites import decode_breakdown as bd  # noqa: E402


def _torch_form(*ops: str):
    """A change whose "before" runs these ops of the model's kernel backend in their torch form
    (dsv4_kernels.ops_torch.TorchOps) instead of the backend's own (the CPU's C kernels)."""
    from dsv4_kernels.ops_torch import TorchOps

    def change(model, on: bool) -> None:
        for op in ops:
            if on:
                model.ops.__dict__.pop(op, None)
            else:
                setattr(model.ops, op, getattr(TorchOps, op).__get__(model.ops))

    return change


def _step_indices(model, on: bool) -> None:
    model.reuse_step_indices = on


def _rope_in_place(model, on: bool) -> None:
    from dsv4_kernels import v4_torch

    v4_torch.ROPE_IN_PLACE = on


def _native_moe(model, on: bool) -> None:
    from dsv4_kernels import cpu_moe

    _native_moe.__dict__.setdefault("on", cpu_moe.MAX_TOKENS)  # the shipped limit, before any patch
    cpu_moe.MAX_TOKENS = _native_moe.on if on else 0


def _native_attn(model, on: bool) -> None:
    width = model.cfg.num_attention_heads * model.cfg.head_dim
    model.attend_in_one_call = on and model.kops is None and model.ops.v4_native_attention(width, model.dtype)


def _take_rows(model, on: bool) -> None:
    model.take_rows = on


CHANGES = {
    "native_mhc": _torch_form("v4_hc_pre_tail"),
    "step_indices": _step_indices,
    "rope_in_place": _rope_in_place,
    "native_moe": _native_moe,
    "native_hc_post": _torch_form("v4_hc_mix"),
    "native_attn": _native_attn,
    "take_rows": _take_rows,
    "native_pool": _torch_form("v4_pool_windows"),
    "native_rms_rope": _torch_form("v4_rms_rope"),
}


def _ops_per_step(engine, steps: int) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as tp:
        for _ in range(steps):
            engine.step()
    return round(sum(e.count for e in tp.key_averages() if e.key.startswith("aten::")) / steps, 1)


def measure(model: Path, c: int, change: str, rounds: int, steps: int) -> dict:
    from dsv4_engine.step_phases import PHASES

    total = rounds * steps * 2 + 2 * steps + 8
    engine = bd._engine(model, c, 128, total)
    seqs = bd._fill(engine, c, 128, total, seed=0)
    m = engine.runner.model
    switch = {"before": lambda: CHANGES[change](m, False), "after": lambda: CHANGES[change](m, True)}
    best: dict = {}
    each: dict = {k: [] for k in switch}
    cpu: dict = {k: [] for k in switch}  # the process's CPU time: what the code costs, less the waits for a core
    ops: dict = {}
    try:
        for name in switch:
            switch[name]()
            ops[name] = _ops_per_step(engine, steps)
        for r in range(rounds):
            for name in list(switch) if r % 2 == 0 else list(reversed(switch)):
                switch[name]()
                PHASES.enable(True, cpu_clock=True)  # phases in CPU time (see the docstring)
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(steps):
                    engine.step()
                each[name].append(round((time.perf_counter() - t0) * 1000 / steps, 2))
                ms = (time.process_time() - c0) * 1000 / steps
                cpu[name].append(round(ms, 2))
                if ms < best.get(name, (1e9,))[0]:  # the round of least CPU, and its phases
                    best[name] = (ms, PHASES.summary().get("decode"))
                PHASES.enable(False)
    finally:
        switch["after"]()
    engine.abort(all_=True)
    engine.step()
    assert all(s.output_ids for s in seqs)
    return {
        "concurrency": c,
        "cpu_ms_per_step_best": {k: round(v[0], 2) for k, v in best.items()},
        "cpu_speedup": round(best["before"][0] / best["after"][0], 2),
        "step_ms_best": {k: min(v) for k, v in each.items()},
        "cpu_ms_each": cpu,
        "torch_ops_per_step": ops,
        "step_ms_each": each,
        "phases_best": {
            k: {p: v["ms_per_step"] for p, v in (b[1] or {}).get("phases", {}).items()} for k, b in best.items()
        },
    }


def measure_prefill(model: Path, c: int, change: str, rounds: int) -> dict:
    """The prefill of c fresh 128-token prompts (until each has its first token), the change
    off and on in alternating rounds, in the process's CPU time."""
    engine = bd._engine(model, c, 128, 8)
    bd._fill(engine, min(c, 4), 128, 2, seed=99)  # warm-up: first-call allocations
    while engine.scheduler.has_work():
        engine.step()
    m = engine.runner.model
    switch = {"before": lambda: CHANGES[change](m, False), "after": lambda: CHANGES[change](m, True)}
    cpu: dict = {k: [] for k in switch}
    tokens: dict = {}
    try:
        for r in range(rounds):
            for name in list(switch) if r % 2 == 0 else list(reversed(switch)):
                switch[name]()
                c0 = time.process_time()
                seqs = bd._fill(engine, c, 128, 1, seed=1000 + r)
                cpu[name].append(round((time.process_time() - c0) * 1000, 1))
                tokens.setdefault(r, {})[name] = [s.output_ids[0] for s in seqs]
                while engine.scheduler.has_work():
                    engine.step()
    finally:
        switch["after"]()
    same = all(t["before"] == t["after"] for t in tokens.values())
    return {
        "concurrency": c,
        "prompt_len": 128,
        "prefill_cpu_ms_best": {k: min(v) for k, v in cpu.items()},
        "prefill_cpu_speedup": round(min(cpu["before"]) / min(cpu["after"]), 2),
        "prefill_cpu_ms_each": cpu,
        "first_tokens_identical": same,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", required=True, help="NAME=DIR")
    p.add_argument("--change", required=True, choices=sorted(CHANGES))
    p.add_argument("-c", "--concurrency", type=int, action="append")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prefill", action="store_true", help="time the prefill of c prompts instead of decode steps")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    torch.set_num_threads(1)
    out = {"change": a.change, "load_average_start": list(os.getloadavg()), "models": {}}
    for spec in a.model:
        name, _, d = spec.partition("=")
        out["models"][name] = []
        for c in a.concurrency or [8, 32]:
            if a.prefill:
                r = measure_prefill(Path(d), c, a.change, a.rounds)
            else:
                r = measure(Path(d), c, a.change, a.rounds, a.steps)
            out["models"][name].append(r)
            print(name, json.dumps(r))
    out["load_average_end"] = list(os.getloadavg())
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
