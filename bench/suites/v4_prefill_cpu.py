"""DeepSeek-V4 prefill, ours against transformers, in CPU time: both in this process with 1 torch
thread, on the same checkpoint and prompts. Ours: c fresh prompts of `prompt_len` tokens through
the engine (chunked at its token budget, 1,024) until each has its first token; transformers: one
forward of the [c, prompt_len] batch with its cache on. Rounds alternate the two; the first
tokens are compared. Where a serving run's TTFT and mixed steps go, without the HTTP side.

    python -m bench.suites.v4_prefill_cpu --model v4-tiny=DIR [-c 32] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from bench.suites import decode_breakdown as bd  # noqa: E402
from bench.harness import loadgen  # noqa: E402


def measure(model: Path, c: int, prompt_len: int, rounds: int) -> dict:
    import transformers

    engine = bd._engine(model, c, prompt_len, 4)
    bd._fill(engine, min(c, 4), prompt_len, 2, seed=99)  # warm-up: first-call allocations
    while engine.scheduler.has_work():
        engine.step()
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    cpu: dict = {"ours": [], "hf": []}
    same = True
    for r in range(rounds):
        seed = 2000 + r
        ids = torch.tensor(loadgen.random_prompts(c, prompt_len, engine.cfg.vocab_size, seed), dtype=torch.long)
        for side in ("ours", "hf") if r % 2 == 0 else ("hf", "ours"):
            c0 = time.process_time()
            if side == "ours":
                seqs = bd._fill(engine, c, prompt_len, 1, seed=seed)
                ours = [s.output_ids[0] for s in seqs]
            else:
                with torch.inference_mode():
                    out = hf(ids, use_cache=True, logits_to_keep=1)
                theirs = out.logits[:, -1].argmax(-1).tolist()
            cpu[side].append(round((time.process_time() - c0) * 1000, 1))
        while engine.scheduler.has_work():
            engine.step()
        same = same and ours == theirs
    return {
        "concurrency": c,
        "prompt_len": prompt_len,
        "ours_prefill_cpu_ms": cpu["ours"],
        "hf_prefill_cpu_ms": cpu["hf"],
        "ours_over_hf_best": round(min(cpu["hf"]) / min(cpu["ours"]), 2),
        "first_tokens_equal": same,
        "load_average": list(os.getloadavg()),
    }


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", required=True, help="NAME=DIR")
    p.add_argument("-c", "--concurrency", type=int, action="append")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    result = {"load_average_start": list(os.getloadavg()), "torch_threads": 1, "models": {}}
    for spec in a.model:
        name, _, d = spec.partition("=")
        result["models"][name] = []
        for c in a.concurrency or [32]:
            r = measure(Path(d), c, a.prompt_len, a.rounds)
            result["models"][name].append(r)
            print(name, json.dumps(r), flush=True)
    result["load_average_end"] = list(os.getloadavg())
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
