"""One side of a serving comparison: the workloads (the same prompts for every side) and the
loop that drives one HTTP server through them, best of N."""

from __future__ import annotations

import asyncio
from typing import Callable, Optional

from rich.console import Console

from bench.harness import loadgen
from bench.harness.procs import load_average
from bench.harness.report import fmt


def build_workloads(
    concurrency: list[int],
    requests_per_client: int,
    prompt_len: int,
    new_tokens: int,
    vocab: int,
    seed: int,
    rounds: int = 0,
    conversations: int = 0,
    append_len: int = 0,
) -> list[dict]:
    """Fixed workloads c{C} (closed loop, C clients) and, with rounds, a multi-round one; HF's
    batch at concurrency C is the first C prompts of c{C}.

    Every workload, every repeat of it (`for_run`) and the warm-up draw their own prompts: a
    server with a prefix cache must not answer a measured run from the prompts of an earlier
    one (the same prompts for every side within one run, so the sides still compare alike)."""
    ws = [
        {
            "name": f"c{c}",
            "kind": "fixed",
            "concurrency": c,
            "prompt_len": prompt_len,
            "new_tokens": new_tokens,
            "prompts": loadgen.random_prompts(c * requests_per_client, prompt_len, vocab, seed * 1000 + c),
            "fresh": {"n": c * requests_per_client, "length": prompt_len, "vocab": vocab, "seed": seed * 1000 + c},
        }
        for c in concurrency
    ]
    if rounds > 0 and conversations > 0:
        mr_args = (conversations, prompt_len, rounds, append_len, vocab)
        first, append = loadgen.multiround_inputs(*mr_args, seed + 7)
        ws.append(
            {
                "name": "multiround",
                "kind": "multiround",
                "concurrency": conversations,
                "first": first,
                "append": append,
                "rounds": rounds,
                "append_len": append_len,
                "new_tokens": new_tokens,
                "context_lens": loadgen.multiround_context_lens(prompt_len, rounds, append_len, new_tokens),
                "fresh": {"args": mr_args, "seed": seed + 7},
            }
        )
    return ws


RUN_SEED_STRIDE = 7919  # a prime: run r's seed never meets another workload's base seed


def for_run(w: dict, r: int) -> dict:
    """Workload w with the prompts of its run r (run 0: w's own; r < 0: the warm-up's)."""
    if r == 0 or "fresh" not in w:
        return w
    f = w["fresh"]
    seed = f["seed"] + RUN_SEED_STRIDE * r
    if w["kind"] == "fixed":
        return {**w, "prompts": loadgen.random_prompts(f["n"], f["length"], f["vocab"], seed)}
    first, append = loadgen.multiround_inputs(*f["args"], seed)
    return {**w, "first": first, "append": append}


def describe(w: dict) -> dict:
    """A workload without its token ids (for the JSON record)."""
    d = {k: v for k, v in w.items() if k not in ("prompts", "first", "append", "fresh")}
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
    """A few short requests first: first-call allocations are not what we measure (prompts of
    their own, which no measured run sends)."""
    prompts = (for_run(w, -1).get("prompts") or for_run(w, -1)["first"])[:4]
    run_workload(
        url,
        model_name,
        {"kind": "fixed", "prompts": prompts, "concurrency": len(prompts), "new_tokens": min(8, w["new_tokens"])},
    )


class Side:
    """One server under the same load as the others: a label, its URL and served model name,
    and optionally a wrapper around each run (e.g. metrics scraped before and after)."""

    def __init__(
        self,
        label: str,
        url: str,
        model_name: Optional[str] = None,
        around: Optional[Callable[[str, Callable[[], dict]], dict]] = None,
    ):
        self.label, self.url, self.model_name, self.around = label, url, model_name, around

    def run(self, w: dict) -> dict:
        def once() -> dict:
            return run_workload(self.url, self.model_name, w)

        return self.around(w["name"], once) if self.around else once()


def drive(sides: list[Side], workloads: list[dict], repeats: int, console: Console) -> dict[str, dict]:
    """Every workload `repeats` times on every side, the sides taking turns run by run (in
    alternating order), so that all sides meet the same background load on a shared machine;
    keeps each side's best run (by tok/s) with every run's tok/s."""
    for side in sides:
        warm_up(side.url, side.model_name, workloads[0])
    out: dict[str, dict] = {side.label: {} for side in sides}
    for w in workloads:
        runs: dict[str, list[dict]] = {side.label: [] for side in sides}
        for r in range(repeats):
            wr = for_run(w, r)
            for side in sides if r % 2 == 0 else list(reversed(sides)):
                res = side.run(wr)
                res["load_average"] = load_average()
                runs[side.label].append(res)
        for side in sides:
            best = loadgen.best_of(runs[side.label])
            best["runs_tok_s"] = [x["output_tok_s"] for x in runs[side.label]]
            best["runs_load_average_1m"] = [x["load_average"][0] for x in runs[side.label]]
            out[side.label][w["name"]] = best
            console.print(
                f"  {side.label:12s} {w['name']:10s} {fmt(best['output_tok_s'])} tok/s  TTFT p50 "
                f"{fmt(best['ttft_p50_ms'])} ms  p99 {fmt(best['ttft_p99_ms'])} ms  ITL p50 "
                f"{fmt(best['itl_p50_ms'], digits=2)} ms  errors {best['errors']}  "
                f"runs {best['runs_tok_s']} at load {best['runs_load_average_1m']}"
            )
            if best["errors"]:
                console.print(f"    [red]first error: {best['first_error']}[/red]")
    return out
