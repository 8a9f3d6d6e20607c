"""Where our engine spends a step: an in-process Engine (no HTTP, no engine thread) prefills a
batch of requests and then decodes, stepped from here, seen three ways:
  breakdown   wall time inside chosen functions (engine step, batch building, forward,
              attention, MLA kernels, MoE, sampling, ...), by wrapping them with timers in this
              process only (inclusive times; nested ones overlap their parents);
  python      cProfile of the decode steps, top functions by own time;
  ops         torch.profiler of the decode steps, top aten ops by self CPU time.

    python -m bench.suites.engine_profile --model DIR [--batch 32] [--prompt-len 128] [--steps 32]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import json
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path
from bench import RESULTS
from typing import Optional

from bench.harness import loadgen


class Timers:
    """Inclusive wall time and call counts of wrapped functions; restores them on exit."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list = []

    def wrap(self, owner, attr: str, label: str) -> None:
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[label] += time.perf_counter() - t0
                self.calls[label] += 1

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, fn))

    def reset(self) -> None:
        self.total.clear()
        self.calls.clear()

    def restore(self) -> None:
        for owner, attr, fn in reversed(self._undo):
            setattr(owner, attr, fn)
        self._undo.clear()

    def table(self, steps: int) -> list[dict]:
        step = self.total.get("engine.step") or 1e-9
        return [
            {
                "function": k,
                "ms_per_step": round(v * 1000 / steps, 3),
                "share_of_step": round(v / step, 3),
                "calls_per_step": round(self.calls[k] / steps, 1),
            }
            for k, v in sorted(self.total.items(), key=lambda kv: -kv[1])
        ]


def instrument(engine) -> Timers:
    from dsv4_engine import engine as engine_mod
    from dsv4_engine.layers import mla, mlp, moe
    from dsv4_engine.models import deepseek_v3 as model_mod
    from dsv4_engine import model_runner

    t = Timers()
    ops = engine.runner.model.ops
    t.wrap(engine_mod.Engine, "step", "engine.step")
    t.wrap(engine_mod.Engine, "_append_token", "engine._append_token (stop checks, detokenize, emit)")
    t.wrap(engine.scheduler.__class__, "schedule", "scheduler.schedule")
    t.wrap(model_runner.ModelRunner, "build_batch", "runner.build_batch (python -> tensors)")
    t.wrap(model_mod.DeepseekV3, "forward", "model.forward")
    t.wrap(mla.MLA, "__call__", "MLA (all of the attention)")
    t.wrap(moe.DeepseekMoE, "__call__", "DeepseekMoE (gate + routed + shared)")
    t.wrap(mlp.GatedMLP, "__call__", "GatedMLP (dense layers)")
    t.wrap(model_runner, "sample", "sampling.sample")
    for name in ("mla_decode", "mla_extend", "moe_route", "moe_experts", "rmsnorm", "rope_interleaved_"):
        t.wrap(ops, name, f"ops.{name}")
    return t


def _seqs(engine, batch: int, prompt_len: int, max_tokens: int, seed: int):
    from dsv4_engine.sampling_params import SamplingParams
    from dsv4_engine.sequence import Sequence

    prompts = loadgen.random_prompts(batch, prompt_len, engine.cfg.vocab_size, seed)
    return [
        Sequence(
            rid=f"prof-{i}", prompt_ids=p, params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        )
        for i, p in enumerate(prompts)
    ]


def closed_loop(engine, concurrency: int, total: int, prompt_len: int, new_tokens: int, seed: int = 3) -> dict:
    """The serving pattern without HTTP: `concurrency` requests in flight, each finished one
    replaced by the next, the engine stepped from here. Also counts the steps that mixed
    prefill with decode (those run every request through mla_extend, not mla_decode)."""
    from dsv4_engine import model_runner

    prompts = loadgen.random_prompts(total, prompt_len, engine.cfg.vocab_size, seed)
    finished: list = []
    kinds = {"decode_only": 0, "mixed_or_prefill": 0}
    build = model_runner.ModelRunner.build_batch

    def counting_build(self, batch, page_size):
        fb = build(self, batch, page_size)
        kinds["decode_only" if fb.all_decode else "mixed_or_prefill"] += 1
        return fb

    def add(i: int) -> None:
        from dsv4_engine.sampling_params import SamplingParams
        from dsv4_engine.sequence import Sequence

        seq = Sequence(
            rid=f"loop-{seed}-{i}",
            prompt_ids=prompts[i],
            params=SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True),
        )
        seq.sink = lambda out: finished.append(out) if out.finished else None
        engine._add(seq)

    model_runner.ModelRunner.build_batch = counting_build
    try:
        nxt = min(concurrency, total)
        for i in range(nxt):
            add(i)
        t0 = time.perf_counter()
        while len(finished) < total:
            before = len(finished)
            engine.step()
            for _ in range(len(finished) - before):
                if nxt < total:
                    add(nxt)
                    nxt += 1
        wall = time.perf_counter() - t0
    finally:
        model_runner.ModelRunner.build_batch = build
    return {
        "concurrency": concurrency,
        "requests": total,
        "wall_s": round(wall, 3),
        "output_tok_s": round(total * new_tokens / wall, 1),
        "steps": kinds,
    }


def profile(
    model: Path,
    batch: int = 32,
    prompt_len: int = 128,
    steps: int = 32,
    out_dir: Optional[Path] = None,
    dtype: str = "float32",
    max_num_batched_tokens: int = 1024,
    top: int = 20,
) -> dict:
    import torch
    from dsv4_engine.engine import Engine
    from dsv4_engine.engine_args import EngineArgs

    pages = batch * (-(-(prompt_len + steps + 8) // 16)) + 16
    engine = Engine(
        EngineArgs(
            model=str(model),
            dtype=dtype,
            kv_pages=pages,
            max_num_seqs=max(batch, 1),
            max_num_batched_tokens=max_num_batched_tokens,
        )
    )
    # A warm-up batch first, so first-call allocations are not in the figures.
    for s in _seqs(engine, min(batch, 4), prompt_len, 4, seed=99):
        engine._add(s)
    while engine.scheduler.has_work():
        engine.step()

    seqs = _seqs(engine, batch, prompt_len, steps + 4, seed=1)
    for s in seqs:
        engine._add(s)
    timers = instrument(engine)
    try:
        # Prefill: until every request has its first token.
        n_prefill = 0
        t0 = time.perf_counter()
        while any(not s.output_ids for s in seqs):
            engine.step()
            n_prefill += 1
        prefill_wall = time.perf_counter() - t0
        prefill_breakdown = timers.table(n_prefill)
        timers.reset()

        # Decode: `steps` steps of the whole batch, under cProfile.
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(steps):
            engine.step()
        prof.disable()
        decode_wall = time.perf_counter() - t0
        decode_breakdown = timers.table(steps)
    finally:
        timers.restore()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    python_top = s.getvalue()

    # The same decode steps once more under torch.profiler (no timers, no cProfile).
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    more = _seqs(engine, batch, prompt_len, steps + 4, seed=2)
    engine.abort(all_=True)
    engine.step()
    for q in more:
        engine._add(q)
    while any(not q.output_ids for q in more):
        engine.step()
    with torch_profile(activities=[ProfilerActivity.CPU]) as tp:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch_decode_wall = time.perf_counter() - t0
    ops_top = tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    ops_rows = sorted(tp.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    op_total = sum(e.self_cpu_time_total for e in tp.key_averages()) or 1

    engine.abort(all_=True)  # the profiled requests still hold slots and pages
    engine.step()
    loop = closed_loop(engine, batch, 2 * batch, prompt_len, steps)

    result = {
        "closed_loop_in_process": loop,
        "batch": batch,
        "prompt_len": prompt_len,
        "decode_steps": steps,
        "dtype": dtype,
        "torch_threads": torch.get_num_threads(),
        "prefill": {
            "steps": n_prefill,
            "wall_s": round(prefill_wall, 4),
            "prompt_tok_s": round(batch * prompt_len / prefill_wall, 1),
            "breakdown": prefill_breakdown,
        },
        "decode": {
            "step_ms": round(decode_wall * 1000 / steps, 3),
            "tok_s_in_process": round(batch * steps / decode_wall, 1),
            "step_ms_without_cprofile_or_timers": round(torch_decode_wall * 1000 / steps, 3),
            "breakdown": decode_breakdown,
        },
        "decode_top_ops": [
            {
                "op": e.key,
                "self_cpu_ms_per_step": round(e.self_cpu_time_total / 1000 / steps, 3),
                "share": round(e.self_cpu_time_total / op_total, 3),
                "calls_per_step": round(e.count / steps, 1),
            }
            for e in ops_rows
        ],
    }
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        text = [
            f"engine profile: batch {batch}, prompt {prompt_len}, {steps} decode steps, {dtype}, "
            f"{torch.get_num_threads()} torch threads\n",
            f"prefill: {n_prefill} steps, {prefill_wall:.3f} s ({result['prefill']['prompt_tok_s']} prompt tok/s)",
            *(
                f"  {r['function']:60s} {r['ms_per_step']:9.2f} ms/step {r['share_of_step']:6.1%}"
                for r in prefill_breakdown
            ),
            f"\ndecode: {result['decode']['step_ms']} ms/step with timers+cProfile, "
            f"{result['decode']['step_ms_without_cprofile_or_timers']} ms/step without",
            *(
                f"  {r['function']:60s} {r['ms_per_step']:9.2f} ms/step {r['share_of_step']:6.1%}"
                for r in decode_breakdown
            ),
            f"\nclosed loop in process (no HTTP): {loop}",
            "\ndecode, python functions by own time (cProfile):",
            python_top,
            "decode, torch ops by self CPU time (torch.profiler):",
            ops_top,
        ]
        (out_dir / "serve_profile.txt").write_text("\n".join(text))
        result["report"] = str(out_dir / "serve_profile.txt")
    return result


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    r = profile(a.model, a.batch, a.prompt_len, a.steps, a.out, a.dtype)
    print(Path(r["report"]).read_text())
    print(json.dumps({k: v for k, v in r.items() if k not in ("decode_top_ops",)}, indent=1)[:3000])
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
