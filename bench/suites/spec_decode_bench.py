"""Speculative decoding with the MTP layer against plain decoding, at concurrency 1, 8 and 32 (or
as asked), on a checkpoint trained on the shipped corpus whose MTP layer was self-distilled
on the model's own greedy continuations (`dsv4 model init --train --train-mtp`). The prompts are
windows of that corpus (what the trained model knows; `--random-prompts` for random ids).

For each --speculative-num-steps K (0 = no speculation) a `dsv4 serve` runs the same greedy
prompts, all servers at once with their passes taking turns (so every K meets the same moments of
a shared machine), `--repeats` passes per concurrency, the fastest kept (with its own acceptance);
reported: output tok/s, TTFT and inter-token latency (client side: tokens a verify step emits
together arrive together, so ITL p50 can be ~0 and the mean is what a reader feels), and the
mean acceptance length the server reports on /v1/loads. Outputs of every K are checked to be
identical to K=0 (greedy speculation must not change a token).

On the shared 2-core machines the numbers are noisy (other work runs beside them): compare the
ratios within one run, not figures across runs.

    python -m bench.suites.spec_decode_bench --steps 0 1 2 3 --concurrency 1 8 32 --out bench/results/spec_decode
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import httpx

from bench.harness.loadgen import random_prompts, run_fixed, summarize  # noqa: E402
from bench.harness.procs import Server, free_port, load_average  # noqa: E402
from bench.harness.report import grouped_bars, machine, now_iso, pyplot, write_json  # noqa: E402


def default_model() -> Path:
    """The tiny preset trained on the shipped corpus, with a self-distilled MTP layer
    (`dsv4 model init --train --train-mtp`), made once into the cache folder."""
    from dsv4_operator.local.up import cache_dir

    out = cache_dir() / "models" / "tiny-trained-mtp-0"
    if not (out / "config.json").exists():
        from dsv4_engine.checkpoint import init_checkpoint
        from dsv4_engine.spec_decode.train import train_base, train_mtp

        print(f"building the tiny model, trained, with a self-distilled MTP layer into {out}", flush=True)
        init_checkpoint(out, preset="tiny", seed=0, mtp=True)
        print(train_base(out), flush=True)
        print(train_mtp(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        help="checkpoint with a (trained) MTP layer (default: tiny, self-distilled once into the cache folder)",
    )
    # extend: `--steps 0 1` and `--steps 0 --steps 1` (what `dsv4 bench spec` passes) both work
    ap.add_argument(
        "--steps",
        "--speculative-num-steps",
        type=int,
        nargs="+",
        action="extend",
        help="K values, 0 = plain (default: 0 1 2 3)",
    )
    ap.add_argument("--concurrency", type=int, nargs="+", action="extend", help="(default: 1 8 32)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="measured passes per K and concurrency; the best is kept")
    ap.add_argument(
        "--random-prompts",
        action="store_true",
        help="random token ids instead of windows of the shipped corpus (what a trained preset knows)",
    )
    ap.add_argument("--out", default="bench/results/spec_decode")
    ap.add_argument("--threads", default="1", help="OMP_NUM_THREADS of the servers")
    a = ap.parse_args()
    a.steps = a.steps or [0, 1, 2, 3]
    a.concurrency = a.concurrency or [1, 8, 32]
    if a.model is None:
        a.model = str(default_model())
    if a.random_prompts:
        prompts = random_prompts(a.prompts, a.prompt_len, 512, seed=0, low=3)
    else:  # seed 7: not the seeds `--train-mtp` draws its prompts with
        from dsv4_engine.spec_decode.train import corpus_prompts

        prompts = corpus_prompts(a.model, a.prompts, a.prompt_len, seed=7)
    logs = Path(a.out).parent / "logs"
    report = {
        "bench": "spec_decode",
        "started": now_iso(),
        "machine": machine(),
        "model": a.model,
        "max_tokens": a.max_tokens,
        "prompts": a.prompts,
        "prompt_len": a.prompt_len,
        "prompt_source": "random ids" if a.random_prompts else "windows of the shipped corpus (seed 7)",
        "repeats": a.repeats,
        "runs": [],
    }
    baseline: dict[int, list] = {}
    # Every K's server runs at once and the passes take turns (K=0, 1, 2, ... then again), so
    # that each K meets the same moments of the shared machine; the best pass of each counts.
    servers = {}
    try:
        for k in a.steps:
            flags = ["--speculative-algorithm", "mtp", "--speculative-num-steps", k] if k else []
            port = free_port()
            servers[k] = Server.dsv4(
                f"spec{k}",
                ["serve", "--model", a.model, "--port", port, "--served-model-name", "m", "--kv-pages", 512, *flags],
                port,
                logs,
                env={"OMP_NUM_THREADS": a.threads},
            )
        for srv in servers.values():
            srv.wait_ready(180)
        for c in a.concurrency:
            best: dict[int, tuple] = {}
            for srv in servers.values():
                asyncio.run(run_fixed(srv.url, "m", prompts[:2], c, 8))  # warm-up
            for _ in range(a.repeats):
                for k, srv in servers.items():
                    before = httpx.get(srv.url + "/v1/loads").json()["counters"]
                    results, wall = asyncio.run(run_fixed(srv.url, "m", prompts, c, a.max_tokens))
                    after = httpx.get(srv.url + "/v1/loads").json()["counters"]
                    s = summarize(results, wall)
                    s["load_average"] = load_average()
                    if k not in best or (s["output_tok_s"] or 0) > (best[k][0]["output_tok_s"] or 0):
                        best[k] = (s, results, before, after)
            for k, srv in servers.items():
                s, results, before, after = best[k]
                gaps = [
                    (r.end - r.first_token) / max(1, r.completion_tokens - 1) for r in results if r.ok and r.first_token
                ]
                s["itl_mean_ms"] = round(1000 * sum(gaps) / len(gaps), 3) if gaps else None
                outs = sorted(r.output_ids for r in results)
                if k == 0:
                    baseline[c] = outs
                s["same_tokens_as_plain"] = baseline.get(c) == outs if c in baseline else None
                loads = httpx.get(srv.url + "/v1/loads").json()

                def delta(key: str) -> float:
                    return after.get(key, 0) - before.get(key, 0)

                s["speculative"] = loads.get("speculative")  # the server's totals since it started
                if k:  # this pass's own figures
                    steps, drafts = delta("spec_decode_num_verify_steps"), delta("spec_decode_num_draft_tokens")
                    accepted = delta("spec_decode_num_accepted_tokens")
                    s["mean_acceptance_length"] = round(1 + accepted / steps, 4) if steps else None
                    s["draft_acceptance_rate"] = round(accepted / drafts, 4) if drafts else None
                s.update(num_steps=k, concurrency=c)
                report["runs"].append(s)
                print(k, c, s, flush=True)
    finally:
        for srv in servers.values():
            srv.stop()
    out = Path(a.out)
    write_json(report, out.with_suffix(".json"))
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    groups = [f"c{c}" for c in a.concurrency]

    def series(key):
        return {
            ("plain" if k == 0 else f"mtp K={k}"): [
                next((r.get(key) for r in report["runs"] if r["num_steps"] == k and r["concurrency"] == c), None)
                for c in a.concurrency
            ]
            for k in a.steps
        }

    grouped_bars(axes[0], groups, series("output_tok_s"), "output tok/s (higher is better)", "tok/s")
    grouped_bars(axes[1], groups, series("itl_mean_ms"), "mean inter-token latency (lower is better)", "ms")
    acc = {lbl: vals for lbl, vals in series("mean_acceptance_length").items() if lbl != "plain"}
    grouped_bars(axes[2], groups, acc, "mean acceptance length (tokens / verify step)", "tokens")
    fig.suptitle(
        f"MTP speculative decoding, {a.model.rstrip('/').split('/')[-1]}, {a.max_tokens} tokens "
        f"(shared 2-core CPU: noisy)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
