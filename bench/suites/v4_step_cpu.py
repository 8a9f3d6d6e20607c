"""DeepSeek-V4 decode steps, ours against transformers' own cached loop, in CPU time: both in this
process with 1 torch thread, on the same checkpoint and the same prompts (c requests of
`prompt_len` tokens), both prefilled, then their decode steps of the whole batch interleaved
(one of ours, one of transformers', ...) and each timed. On a
shared machine the wall time of a step is mostly the wait for a core (load 17 on 2 cores: a
v4-tiny step is ~12 ms of CPU in ~100 ms of wall), and that wait does not fall evenly on two
programs run minutes apart; CPU time is each program's own cost. Also compares the greedy tokens.

    python -m bench.suites.v4_step_cpu --model v4-tiny=DIR [-c 8 -c 32] [--steps 16] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from bench.suites import decode_breakdown as bd  # noqa: E402
from bench.harness import loadgen  # noqa: E402


def _ours(model: Path, c: int, prompt_len: int, steps: int):
    engine = bd._engine(model, c, prompt_len, steps)
    bd._fill(engine, min(c, 4), prompt_len, 4, seed=99)  # warm-up: first-call allocations
    while engine.scheduler.has_work():
        engine.step()
    seqs = bd._fill(engine, c, prompt_len, steps + 1, seed=0)  # prefilled: each has its first token
    return engine, seqs


def _hf(model: Path, c: int, prompt_len: int, vocab: int):
    import transformers

    m = transformers.DeepseekV4ForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    ids = torch.tensor(loadgen.random_prompts(c, prompt_len, vocab, 0), dtype=torch.long)
    with torch.inference_mode():
        out = m(ids, use_cache=True, logits_to_keep=1)
    return m, out, [out.logits[:, -1].argmax(-1, keepdim=True)]


def interleaved(model: Path, c: int, prompt_len: int, steps: int, vocab: int) -> dict:
    """Both prefilled, then one decode step of ours, one of transformers', and so on: the two
    see the same machine, step by step."""
    engine, seqs = _ours(model, c, prompt_len, steps)
    m, out, toks = _hf(model, c, prompt_len, vocab)
    cpu: dict = {"ours": [], "hf": []}
    wall: dict = {"ours": [], "hf": []}

    def timed(side: str, fn) -> None:
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        cpu[side].append((time.process_time() - c0) * 1000)
        wall[side].append((time.perf_counter() - t0) * 1000)

    def hf_step() -> None:
        nonlocal out
        with torch.inference_mode():
            out = m(toks[-1], cache=out.past_key_values, use_cache=True)
            toks.append(out.logits[:, -1].argmax(-1, keepdim=True))

    for _ in range(steps):
        timed("ours", engine.step)
        timed("hf", hf_step)
    ours_tokens = [s.output_ids[: steps + 1] for s in seqs]
    hf_tokens = torch.cat(toks, 1).tolist()
    engine.abort(all_=True)
    engine.step()
    engine = None
    gc.collect()
    return {"cpu_ms": cpu, "wall_ms": wall, "tokens": (ours_tokens, hf_tokens)}


def _stats(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 2), "min": round(min(xs), 2)}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", required=True, help="NAME=DIR")
    p.add_argument("-c", "--concurrency", type=int, action="append")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    result = {"load_average_start": list(os.getloadavg()), "torch_threads": 1, "models": {}}
    for spec in a.model:
        name, _, d = spec.partition("=")
        vocab = json.loads((Path(d) / "config.json").read_text())["vocab_size"]
        result["models"][name] = []
        for c in a.concurrency or [8, 32]:
            run = interleaved(Path(d), c, a.prompt_len, a.steps, vocab)
            o = {"cpu_ms": run["cpu_ms"]["ours"], "wall_ms": run["wall_ms"]["ours"]}
            h = {"cpu_ms": run["cpu_ms"]["hf"], "wall_ms": run["wall_ms"]["hf"]}
            ours_tokens, hf_tokens = run["tokens"]
            same = sum(x == y for ro, rh in zip(ours_tokens, hf_tokens) for x, y in zip(ro, rh))
            total = sum(min(len(ro), len(rh)) for ro, rh in zip(ours_tokens, hf_tokens))
            r = {
                "concurrency": c,
                "prompt_len": a.prompt_len,
                "decode_steps": a.steps,
                "ours_step_cpu_ms": _stats(o["cpu_ms"]),
                "hf_step_cpu_ms": _stats(h["cpu_ms"]),
                "ours_over_hf_cpu": round(statistics.median(h["cpu_ms"]) / statistics.median(o["cpu_ms"]), 2),
                "ours_step_wall_ms": _stats(o["wall_ms"]),
                "hf_step_wall_ms": _stats(h["wall_ms"]),
                "greedy_tokens_equal": f"{same}/{total}",
                "load_average": list(os.getloadavg()),
            }
            result["models"][name].append(r)
            print(name, json.dumps(r), flush=True)
    result["load_average_end"] = list(os.getloadavg())
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
