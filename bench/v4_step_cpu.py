"""DeepSeek-V4 decode steps, ours against transformers' own cached loop, in CPU time: both in this
process with 1 torch thread, on the same checkpoint and the same prompts (c requests of
`prompt_len` tokens), each timed per decode step of the whole batch after its prefill. On a
shared machine the wall time of a step is mostly the wait for a core (load 17 on 2 cores: a
v4-tiny step is ~12 ms of CPU in ~100 ms of wall), and that wait does not fall evenly on two
programs run minutes apart; CPU time is each program's own cost. Also compares the greedy tokens.

    python bench/v4_step_cpu.py --model v4-tiny=DIR [-c 8 -c 32] [--steps 16] [--out FILE]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_breakdown as bd  # noqa: E402
import loadgen  # noqa: E402


def ours(model: Path, c: int, prompt_len: int, steps: int) -> dict:
    engine = bd._engine(model, c, prompt_len, steps)
    bd._fill(engine, min(c, 4), prompt_len, 4, seed=99)  # warm-up: first-call allocations
    while engine.scheduler.has_work():
        engine.step()
    seqs = bd._fill(engine, c, prompt_len, steps + 1, seed=0)  # prefilled: each has its first token
    cpu, wall = [], []
    for _ in range(steps):
        c0, t0 = time.process_time(), time.perf_counter()
        engine.step()
        cpu.append((time.process_time() - c0) * 1000)
        wall.append((time.perf_counter() - t0) * 1000)
    tokens = [s.output_ids[: steps + 1] for s in seqs]
    engine.abort(all_=True)
    engine.step()
    return {"cpu_ms": cpu, "wall_ms": wall, "tokens": tokens, "prompts": None}


def hf(model: Path, c: int, prompt_len: int, steps: int, vocab: int) -> dict:
    import transformers

    m = transformers.DeepseekV4ForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    prompts = loadgen.random_prompts(c, prompt_len, vocab, 0)
    ids = torch.tensor(prompts, dtype=torch.long)
    cpu, wall = [], []
    with torch.inference_mode():
        out = m(ids, use_cache=True, logits_to_keep=1)
        toks = [out.logits[:, -1].argmax(-1, keepdim=True)]
        for _ in range(steps):
            c0, t0 = time.process_time(), time.perf_counter()
            out = m(toks[-1], cache=out.past_key_values, use_cache=True)
            toks.append(out.logits[:, -1].argmax(-1, keepdim=True))
            cpu.append((time.process_time() - c0) * 1000)
            wall.append((time.perf_counter() - t0) * 1000)
    del m
    gc.collect()
    return {"cpu_ms": cpu, "wall_ms": wall, "tokens": torch.cat(toks, 1).tolist()}


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
            o = ours(Path(d), c, a.prompt_len, a.steps)
            h = hf(Path(d), c, a.prompt_len, a.steps, vocab)
            same = sum(x == y for ro, rh in zip(o["tokens"], h["tokens"]) for x, y in zip(ro, rh))
            total = sum(min(len(ro), len(rh)) for ro, rh in zip(o["tokens"], h["tokens"]))
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
