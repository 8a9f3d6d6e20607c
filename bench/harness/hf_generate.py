"""The transformers baseline: `DeepseekV3ForCausalLM.generate` on the same checkpoint and the
same prompts, batched (batch = the concurrency level), greedy, exactly `new_tokens` new tokens.

DeepSeek-V4: `DeepseekV4ForCausalLM` in a batched greedy loop over its own cache (the prompt in
one forward, then one token per forward), because transformers 5.24's `generate` on V4 does not
reproduce the model's own forward after the first token (seen on v4-tiny in fp32, with and
without its cache), while this loop is what the oracle tests match the engine against.

Runs in its own process (serve_bench.py starts it) so that its peak RSS is its own:

    python -m bench.harness.hf_generate SPEC.json OUT.json

SPEC: {"model": DIR, "dtype": "float32", "threads": N | null, "new_tokens": 64, "repeats": 3,
       "fixed": [{"name": "c8", "prompts": [[ids...], ...]}, ...],
       "multiround": {"first": [[ids...]...], "append": [[[ids...] per round] per conv], "rounds": 4} | null}
OUT:  {"fixed": {name: {"batch", "output_tok_s", "wall_s", "runs": [...]}}, "multiround": {...},
       "peak_rss_bytes", "rss_after_load_bytes", "torch_threads", "versions"}
"""

from __future__ import annotations

import json
import resource
import sys
import time

import psutil
import torch


def generate(model, batch: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float]:
    """One batched greedy generate; every row has the same length (no padding needed)."""
    ids = torch.tensor(batch, dtype=torch.long)
    t0 = time.perf_counter()
    if model.config.model_type == "deepseek_v4":
        with torch.inference_mode():
            out = model(ids, use_cache=True, logits_to_keep=1)
            toks = []
            for i in range(new_tokens):
                toks.append(out.logits[:, -1].argmax(-1, keepdim=True))
                if i + 1 < new_tokens:
                    out = model(toks[-1], cache=out.past_key_values, use_cache=True)
        return torch.cat(toks, 1).tolist(), time.perf_counter() - t0
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    wall = time.perf_counter() - t0
    return out[:, ids.shape[1] :].tolist(), wall


def multiround(model, first: list[list[int]], append: list[list[list[int]]], rounds: int, new_tokens: int) -> float:
    """All conversations in one batch per round (their contexts grow in step, so they stay the
    same length); returns the total generate time over the rounds."""
    contexts = [list(p) for p in first]
    total = 0.0
    for r in range(rounds):
        answers, wall = generate(model, contexts, new_tokens)
        total += wall
        if r + 1 < rounds:
            contexts = [c + a + append[i][r] for i, (c, a) in enumerate(zip(contexts, answers))]
    return total


def main(spec_path: str, out_path: str) -> None:
    import transformers

    spec = json.loads(open(spec_path).read())
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    new_tokens, repeats = spec["new_tokens"], spec["repeats"]
    dtype = getattr(torch, spec.get("dtype", "float32"))
    model_type = json.loads(open(f"{spec['model']}/config.json").read()).get("model_type")
    cls = transformers.DeepseekV4ForCausalLM if model_type == "deepseek_v4" else transformers.DeepseekV3ForCausalLM
    model = cls.from_pretrained(spec["model"], dtype=dtype).eval()
    rss_after_load = psutil.Process().memory_info().rss
    generate(model, [spec["fixed"][0]["prompts"][0]], 2)  # warm-up (first-call allocations)

    result: dict = {"fixed": {}, "multiround": None}
    for w in spec["fixed"]:
        runs = [generate(model, w["prompts"], new_tokens)[1] for _ in range(repeats)]
        best = min(runs)
        tokens = len(w["prompts"]) * new_tokens
        result["fixed"][w["name"]] = {
            "batch": len(w["prompts"]),
            "completion_tokens": tokens,
            "wall_s": round(best, 4),
            "output_tok_s": round(tokens / best, 2),
            "runs_s": [round(x, 4) for x in runs],
        }
        print(
            f"hf generate {w['name']}: batch {len(w['prompts'])}, {tokens / best:.1f} tok/s",
            file=sys.stderr,
            flush=True,
        )
    mr = spec.get("multiround")
    if mr:
        runs = [multiround(model, mr["first"], mr["append"], mr["rounds"], new_tokens) for _ in range(repeats)]
        best = min(runs)
        tokens = len(mr["first"]) * mr["rounds"] * new_tokens
        result["multiround"] = {
            "batch": len(mr["first"]),
            "rounds": mr["rounds"],
            "completion_tokens": tokens,
            "wall_s": round(best, 4),
            "output_tok_s": round(tokens / best, 2),
            "runs_s": [round(x, 4) for x in runs],
        }
        print(f"hf generate multiround: {tokens / best:.1f} tok/s", file=sys.stderr, flush=True)
    # ru_maxrss is KiB on Linux: the whole life of this process, loading included.
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result["rss_after_load_bytes"] = rss_after_load
    result["torch_threads"] = torch.get_num_threads()
    result["versions"] = {"transformers": transformers.__version__, "torch": torch.__version__}
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m bench.harness.hf_generate SPEC.json OUT.json")
    main(sys.argv[1], sys.argv[2])
