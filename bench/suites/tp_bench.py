"""`--tp-size` side by side: what each rank holds, and what the engine generates, at tp 1, 2, ...

    python -m bench.suites.tp_bench [--presets tiny,mla512,v4-tiny] [--tp 1,2] [--batch 8]
                             [--new-tokens 32] [--runs 3] [--out bench/results/tp_bench.json]
    python -m bench.suites.tp_bench --quick        # smoke: tiny, tp 1 and 2, a few tokens, one run

Memory: resident weight bytes of every rank's model, measured from the tensors it keeps (built
in this process with each rank's plan; no group needed to build). Throughput: an in-process
engine (rank 0 here, the other ranks its children; gloo on CPU, NCCL on CUDA) generates
`--new-tokens` greedy tokens for `--batch` requests; best of `--runs`, tokens per second of
wall time from submit to the last token. On CPU, tp > 1 is a correctness shape, not a speedup:
the ranks share the cores and each step adds 2 all-reduces per layer."""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Optional


from bench.harness import report  # noqa: E402
from bench.harness.checkpoints import RESULTS, ensure_model  # noqa: E402


def rank_bytes(model: Path, tp: int, device: str) -> list[int]:
    from dsv4_engine.model_runner import ModelRunner
    from dsv4_engine.parallel.group import TPRank
    from dsv4_engine.parallel.plan import Shard
    from dsv4_engine.parallel.sharded import resident_weight_bytes

    if tp == 1:
        return [resident_weight_bytes(ModelRunner(str(model), device=device, kernel_backend="cpu").model)]
    return [
        resident_weight_bytes(
            ModelRunner(str(model), device=device, kernel_backend="cpu", tp=TPRank(Shard(r, tp), None, None)).model
        )
        for r in range(tp)
    ]


def throughput(model: Path, tp: int, batch: int, new_tokens: int, runs: int, device: str) -> dict:
    from dsv4_engine.engine import Engine
    from dsv4_engine.engine_args import EngineArgs
    from dsv4_engine.sampling_params import SamplingParams
    from dsv4_engine.sequence import Sequence

    engine = Engine(
        EngineArgs(
            model=str(model),
            device=device,
            kv_pages=max(64, batch * 8),
            page_size=16,
            max_num_seqs=max(batch, 1),
            tp_size=tp,
        )
    )
    rng = random.Random(0)
    best: Optional[float] = None
    tokens: list[list[int]] = []
    try:
        for run in range(runs):
            outs: dict[str, list[int]] = {}
            done: set[str] = set()

            def sink_for(rid):
                def sink(o):
                    outs.setdefault(rid, []).extend(o.token_ids)
                    if o.finished:
                        done.add(rid)

                return sink

            t0 = time.perf_counter()
            for i in range(batch):
                prompt = [rng.randrange(3, engine.cfg.vocab_size) for _ in range(32)]
                engine.submit(
                    Sequence(
                        f"r{run}-{i}",
                        prompt,
                        SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True),
                        sink=sink_for(f"r{i}"),
                    )
                )
            while len(done) < batch:
                engine.step()
            wall = time.perf_counter() - t0
            tok_s = batch * new_tokens / wall
            best = tok_s if best is None else max(best, tok_s)
            tokens = [outs[f"r{i}"] for i in range(batch)]
    finally:
        if engine.tp is not None:
            engine.tp.close()
    return {"best_tok_s": round(best or 0.0, 2), "first_tokens": [t[:4] for t in tokens]}


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny,mla512,v4-tiny")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "tp_bench.json")
    a = ap.parse_args(argv)
    if a.quick:
        a.presets, a.tp, a.batch, a.new_tokens, a.runs = "tiny", "1,2", 2, 4, 1
    tps = [int(x) for x in a.tp.split(",")]
    rows = []
    for preset in a.presets.split(","):
        model = ensure_model(None, preset, 0)
        for tp in tps:
            per_rank = rank_bytes(model, tp, a.device)
            t = throughput(model, tp, a.batch, a.new_tokens, a.runs, a.device)
            rows.append(
                {
                    "preset": preset,
                    "tp": tp,
                    "rank_weight_bytes": per_rank,
                    "rank_weight_mib": [report.mib(b) for b in per_rank],
                    **t,
                }
            )
            print(
                f"{preset:10s} tp {tp}: weights per rank {[report.mib(b) for b in per_rank]} MiB, "
                f"{t['best_tok_s']} tok/s",
                flush=True,
            )
    # Same greedy tokens at every tp size (the bench also checks what it measures).
    for preset in a.presets.split(","):
        firsts = {r["tp"]: r["first_tokens"] for r in rows if r["preset"] == preset}
        if len({str(v) for v in firsts.values()}) != 1:
            sys.exit(f"error: {preset}: tokens differ across tp sizes: {firsts}")
    out = {"bench": "tp", "started": report.now_iso(), "args": {k: str(v) for k, v in vars(a).items()}, "rows": rows}
    report.write_json(out, a.out)
    plt = report.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    groups = a.presets.split(",")

    def value(preset, tp, key):
        r = next((r for r in rows if r["preset"] == preset and r["tp"] == tp), None)
        return None if r is None else key(r)

    report.grouped_bars(
        ax1,
        groups,
        {f"tp {tp}": [value(p, tp, lambda r: max(r["rank_weight_mib"])) for p in groups] for tp in tps},
        "Weights held by the largest rank",
        "MiB",
    )
    report.grouped_bars(
        ax2,
        groups,
        {f"tp {tp}": [value(p, tp, lambda r: r["best_tok_s"]) for p in groups] for tp in tps},
        f"Generation, batch {a.batch} ({a.device})",
        "tokens / s",
    )
    fig.tight_layout()
    fig.savefig(a.out.with_suffix(".png"), dpi=110)
    print(f"wrote {a.out} and {a.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
