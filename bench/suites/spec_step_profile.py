"""Where a speculative step's time goes, against a plain decode step (in-process, one request,
steps driven on this thread, one torch thread): the target's forward, the MTP block's forward
(catch-up and draft chain), the host-side batch building and uploads, and the rest.

    python -m bench.suites.spec_step_profile --model DIR [--steps 1] [--max-tokens 64]

Prints ms per engine step for each part and tokens per step; the ratio of a speculative step's
cost to a plain one is the acceptance length it needs to break even.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch


def profile(model: str, spec_steps: int, max_tokens: int, prompt: list[int]) -> dict:
    import dsv4_engine.spec_decode.speculator as speculator
    from dsv4_engine.engine import Engine
    from dsv4_engine.engine_args import EngineArgs
    from dsv4_engine.sampling_params import SamplingParams
    from dsv4_engine.sequence import Sequence

    acc: dict[str, float] = collections.defaultdict(float)

    def timed(obj, name: str, key: str) -> None:
        f = getattr(obj, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[key] += time.perf_counter() - t

        setattr(obj, name, wrapper)

    out = {}
    for k in (0, spec_steps):
        flags = dict(speculative_algorithm="mtp", speculative_num_steps=k) if k else {}
        e = Engine(
            EngineArgs(
                model=model, device="cpu", kernel_backend="cpu", kv_pages=256, enable_prefix_cache=False, **flags
            )
        )
        if k:
            timed(e.spec.target, "hidden", "target forward (verify)")
            timed(e.spec.mtp, "forward", "MTP forward (catch-up + chain)")
            timed(e.spec.target_buffers, "upload", "uploads")
            timed(e.spec.draft_buffers, "upload", "uploads")
            timed(e.spec, "step", "step total")
            host_batch = speculator.host_batch

            def hb(*a, **kw):
                t = time.perf_counter()
                try:
                    return host_batch(*a, **kw)
                finally:
                    acc["host batches"] += time.perf_counter() - t

            speculator.host_batch = hb
        else:
            timed(e.runner, "forward", "target forward (decode)")
            timed(e.runner, "build_batch", "host batch + upload")
            timed(e.runner, "step", "step total")
        timed(e, "_speculated" if k else "_append_token", "emit tokens")
        done: list = []
        e.submit(
            Sequence(
                "p",
                prompt,
                SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                sink=lambda o: o.finished and done.append(o),
            )
        )
        e.step()  # the prefill
        acc.clear()
        t, n = time.perf_counter(), 0
        while not done:
            e.step()
            n += 1
        wall = time.perf_counter() - t
        if k:
            speculator.host_batch = host_batch
        out[k] = {
            "steps": n,
            "ms_per_step": round(1000 * wall / n, 2),
            "tokens_per_step": round((max_tokens - 1) / n, 3),
            "parts_ms_per_step": {key: round(1000 * v / n, 2) for key, v in sorted(acc.items(), key=lambda x: -x[1])},
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=1, help="--speculative-num-steps of the speculative run")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--random-prompt", action="store_true", help="ids 5..28 instead of a window of the shipped corpus")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.random_prompt:
        prompt = list(range(5, 29))
    else:  # what a preset trained with `dsv4 model init --train` knows (the bench's prompts)
        from dsv4_engine.spec_decode.train import corpus_prompts

        prompt = corpus_prompts(a.model, 1, 24, seed=7)[0]
    res = profile(a.model, a.steps, a.max_tokens, prompt)
    for k, r in res.items():
        print(f"{'plain' if not k else f'K={k}'}: {r['ms_per_step']} ms/step, {r['tokens_per_step']} tokens/step")
        for key, v in r["parts_ms_per_step"].items():
            print(f"    {key:34s} {v:6.2f} ms")
    plain, spec = res[0], res[a.steps]
    need = spec["ms_per_step"] / plain["ms_per_step"] * plain["tokens_per_step"]
    print(
        f"a K={a.steps} step costs {spec['ms_per_step'] / plain['ms_per_step']:.2f}x a plain one: break-even at "
        f"{need:.2f} tokens per step (reached: {spec['tokens_per_step']})"
    )


if __name__ == "__main__":
    main()
