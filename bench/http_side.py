"""One side of a serving comparison: the workloads (the same prompts for every side) and the
loop that drives one HTTP server through them, best of N."""

from __future__ import annotations

import asyncio
from typing import Callable, Optional

from rich.console import Console

import loadgen
from procs import load_average
from report import fmt


def build_workloads(concurrency: list[int], requests_per_client: int, prompt_len: int, new_tokens: int,
                    vocab: int, seed: int, rounds: int = 0, conversations: int = 0, append_len: int = 0) -> list[dict]:
    """Fixed workloads c{C} (closed loop, C clients) and, with rounds, a multi-round one; HF's
    batch at concurrency C is the first C prompts of c{C}."""
    most = max(concurrency) * requests_per_client
    pool = loadgen.random_prompts(most, prompt_len, vocab, seed)
    ws = [{"name": f"c{c}", "kind": "fixed", "concurrency": c, "prompt_len": prompt_len, "new_tokens": new_tokens,
           "prompts": pool[: c * requests_per_client]} for c in concurrency]
    if rounds > 0 and conversations > 0:
        first, append = loadgen.multiround_inputs(conversations, prompt_len, rounds, append_len, vocab, seed + 7)
        ws.append({"name": "multiround", "kind": "multiround", "concurrency": conversations, "first": first,
                   "append": append, "rounds": rounds, "append_len": append_len, "new_tokens": new_tokens,
                   "context_lens": loadgen.multiround_context_lens(prompt_len, rounds, append_len, new_tokens)})
    return ws


def describe(w: dict) -> dict:
    """A workload without its token ids (for the JSON record)."""
    d = {k: v for k, v in w.items() if k not in ("prompts", "first", "append")}
    d["requests"] = len(w["prompts"]) if w["kind"] == "fixed" else len(w["first"]) * w["rounds"]
    return d


def run_workload(url: str, model_name: Optional[str], w: dict) -> dict:
    n = w["new_tokens"]
    if w["kind"] == "fixed":
        results, wall = asyncio.run(loadgen.run_fixed(url, model_name, w["prompts"], w["concurrency"], n))
        return loadgen.summarize(results, wall)
    results, wall = asyncio.run(loadgen.run_multiround(url, model_name, w["first"], w["rounds"], w["append"], n))
    s = loadgen.summarize(results, wall)
    s["per_round"] = loadgen.per_round(results)
    return s


def warm_up(url: str, model_name: Optional[str], w: dict) -> None:
    """A few short requests first: first-call allocations are not what we measure."""
    prompts = (w.get("prompts") or w["first"])[:4]
    run_workload(url, model_name, {"kind": "fixed", "prompts": prompts, "concurrency": len(prompts),
                                   "new_tokens": min(8, w["new_tokens"])})


def drive(label: str, url: str, model_name: Optional[str], workloads: list[dict], repeats: int, console: Console,
          around: Optional[Callable[[str, Callable[[], dict]], dict]] = None) -> dict:
    """Each workload `repeats` times; keeps the best run (by tok/s) with every run's tok/s.
    `around(name, run)` may wrap each run (e.g. to scrape metrics before and after it)."""
    warm_up(url, model_name, workloads[0])
    out = {}
    for w in workloads:
        def once(w=w) -> dict:
            return run_workload(url, model_name, w)

        runs = [around(w["name"], once) if around else once() for _ in range(repeats)]
        best = loadgen.best_of(runs)
        best["runs_tok_s"] = [r["output_tok_s"] for r in runs]
        best["load_average"] = load_average()
        out[w["name"]] = best
        console.print(f"  {label:10s} {w['name']:10s} {fmt(best['output_tok_s'])} tok/s  TTFT p50 "
                      f"{fmt(best['ttft_p50_ms'])} ms  p99 {fmt(best['ttft_p99_ms'])} ms  ITL p50 "
                      f"{fmt(best['itl_p50_ms'], digits=2)} ms  errors {best['errors']}  load {best['load_average'][0]}")
        if best["errors"]:
            console.print(f"    [red]first error: {best['first_error']}[/red]")
    return out
