"""TP vs DP attention at fixed memory (issue 46): the KV a group of N ranks holds, and what it
generates at a batch that fills it.

    dsv4 bench dp_attention [--presets tiny,mla512] [--size 2] [--weights-share 0.6]
                            [--prompt 64] [--new-tokens 32] [--runs 3] [--out DIR/dp_attention.json]
    dsv4 bench dp_attention --quick     # smoke: tiny, one short run

Fixed memory: every rank of both layouts gets the same memory M, sized so that the weights of a
tensor-parallel rank take `--weights-share` of it (M = TP rank weights / share). The KV pool of a
rank is M less that rank's own weights (measured from the tensors the rank's plan keeps): a DP
rank holds more weights (attention and dense layers whole on every rank), so less KV per rank,
but N pools of its own requests instead of one pool every rank mirrors. Each engine is told its
KV budget (`--kv-memory-gb`) and the capacity is what the engine itself reports (its /v1/loads:
`kv_pages_total`, `kv_sizing`, `dp_ranks`): KV tokens, and requests of prompt + new tokens held
at once (whole pages, each request on one rank). Throughput: each layout at the batch that fills
its own pools, `--new-tokens` greedy tokens a request, tokens per second of wall time from submit
to the last token, best of `--runs` (DP's rounds alternate its full batch and TP's batch).
On CPU the N ranks share the machine's cores and the MoE's
gather per layer is gloo's: the throughput ratio says what the bigger batch buys here, not a GPU's.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path
from typing import Optional

from bench.harness import report
from bench.harness.checkpoints import RESULTS, ensure_model

OUT = RESULTS / "dp_attention" / "dp_attention.json"
PAGE_SIZE = 16


def rank_weight_bytes(model: Path, size: int, data_parallel: bool) -> int:
    """The largest rank's resident weights under that layout (built in this process, no group)."""
    from dsv4_engine.model_runner import ModelRunner
    from dsv4_engine.parallel.group import TPRank
    from dsv4_engine.parallel.plan import Shard
    from dsv4_engine.parallel.sharded import resident_weight_bytes

    return max(
        resident_weight_bytes(
            ModelRunner(
                str(model), device="cpu", kernel_backend="cpu", tp=TPRank(Shard(r, size), None, None, data_parallel)
            ).model
        )
        for r in range(size)
    )


def engine_for(model: Path, size: int, dp: int, kv_bytes: int, max_seqs: int):
    from dsv4_engine.engine import Engine
    from dsv4_engine.engine_args import EngineArgs

    return Engine(
        EngineArgs(
            model=str(model),
            device="cpu",
            kernel_backend="cpu",
            kv_memory_gb=kv_bytes / (1 << 30),
            page_size=PAGE_SIZE,
            max_num_seqs=max_seqs,
            max_num_batched_tokens=4096,
            tp_size=size,
            dp_size=dp,
            enable_prefix_cache=False,  # random prompts share nothing: every page is a request's own
        )
    )


def capacity(loads: dict, request_tokens: int) -> dict:
    """KV tokens and whole requests the pools hold, from the engine's /v1/loads."""
    per_request = math.ceil(request_tokens / PAGE_SIZE)
    pools = [r["kv_pages_total"] for r in loads["dp_ranks"]] if "dp_ranks" in loads else [loads["kv_pages_total"]]
    return {
        "kv_pages_per_rank": pools,
        "kv_tokens": sum(pools) * PAGE_SIZE,
        "requests_held": sum(p // per_request for p in pools),
        "kv_sizing": loads.get("kv_sizing"),
    }


def generate_once(engine, batch: int, prompt_len: int, new_tokens: int, tag: str) -> tuple[float, int]:
    """(tokens/s, preemptions) of `batch` requests submitted at once, to the last token."""
    from dsv4_engine.sampling_params import SamplingParams
    from dsv4_engine.sequence import Sequence

    rng = random.Random(0)  # the same prompts on every side and every round
    done: set[str] = set()
    seqs = []
    t0 = time.perf_counter()
    for i in range(batch):
        prompt = [rng.randrange(3, engine.cfg.vocab_size) for _ in range(prompt_len)]
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        seqs.append(Sequence(f"{tag}-{i}", prompt, params, sink=lambda o: o.finished and done.add(o.rid)))
        engine.submit(seqs[-1])
    while len(done) < batch:
        engine.step()
    return batch * new_tokens / (time.perf_counter() - t0), sum(s.num_preemptions for s in seqs)


def compare(model: Path, size: int, rank_memory: int, a) -> dict[str, dict]:
    """TP, then DP (one process holds one group at a time): each engine's capacity from its own
    report, then `--runs` rounds of its sides, best of them; DP's rounds alternate its full
    batch and TP's batch, so that the machine's load drifts over both alike."""
    rows: dict[str, dict] = {}
    request_tokens = a.prompt + a.new_tokens
    for layout, dp in (("tp", 1), ("dp", size)):
        weights = rank_weight_bytes(model, size, dp > 1)
        kv_bytes = rank_memory - weights
        engine = engine_for(model, size, dp, kv_bytes, a.max_batch)  # V3's KV is all paged: no slot rows
        try:
            cap = capacity(engine.loads(), request_tokens)
            batch = min(cap["requests_held"], a.max_batch)
            sides = {layout: batch}
            if layout == "dp":
                sides["at_tp_batch"] = min(rows["tp"]["batch"], batch)
            seen: dict[str, list[float]] = {k: [] for k in sides}
            preempted = dict.fromkeys(sides, 0)
            for run in range(a.runs):
                for name, n in sides.items():
                    tok_s, pre = generate_once(engine, n, a.prompt, a.new_tokens, f"{name}{run}")
                    seen[name].append(round(tok_s, 1))
                    preempted[name] += pre
        finally:
            if engine.tp is not None:
                engine.tp.close()
        rows[layout] = {
            "layout": layout,
            "ranks": size,
            "rank_memory_mib": report.mib(rank_memory),
            "rank_weight_mib": report.mib(weights),
            "rank_kv_budget_mib": report.mib(kv_bytes),
            **cap,
            "batch": batch,
            "best_tok_s": max(seen[layout]),
            "runs_tok_s": seen[layout],
            "preemptions": preempted[layout],
        }
        if "at_tp_batch" in sides:
            rows[layout]["at_tp_batch"] = {
                "batch": sides["at_tp_batch"],
                "best_tok_s": max(seen["at_tp_batch"]),
                "runs_tok_s": seen["at_tp_batch"],
                "preemptions": preempted["at_tp_batch"],
            }
    return rows


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny,mla512")
    ap.add_argument("--size", type=int, default=2, help="Ranks of both layouts (--tp-size; --dp-size for DP).")
    ap.add_argument(
        "--weights-share", type=float, default=0.6, help="Share of a rank's memory a TP rank's weights take."
    )
    ap.add_argument("--prompt", type=int, default=64, help="Prompt tokens a request.")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=256, help="Cap on the batch (and slot rows) of a layout.")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    if a.quick:
        a.presets, a.prompt, a.new_tokens, a.runs, a.max_batch = "tiny", 16, 4, 1, 32
    rows, ratios = [], {}
    for preset in a.presets.split(","):
        model = ensure_model(None, preset, 0)
        rank_memory = int(rank_weight_bytes(model, a.size, False) / a.weights_share)
        pair = compare(model, a.size, rank_memory, a)
        for row in pair.values():
            rows.append({"preset": preset, **row})
            print(
                f"{preset:8s} {row['layout']} {a.size}: rank {row['rank_memory_mib']} MiB = weights "
                f"{row['rank_weight_mib']} + KV {row['rank_kv_budget_mib']}; holds {row['kv_tokens']} KV tokens, "
                f"{row['requests_held']} requests; batch {row['batch']}: {row['best_tok_s']} tok/s "
                f"(runs {row['runs_tok_s']}, {row['preemptions']} preemptions)",
                flush=True,
            )
        ratios[preset] = {
            k: report.ratio(pair["dp"][k], pair["tp"][k]) for k in ("kv_tokens", "requests_held", "best_tok_s")
        }
        same = pair["dp"]["at_tp_batch"]
        ratios[preset]["best_tok_s_at_tp_batch"] = report.ratio(same["best_tok_s"], pair["tp"]["best_tok_s"])
        print(f"{preset:8s} dp {a.size} at tp's batch {same['batch']}: {same['best_tok_s']} tok/s", flush=True)
        print(f"{preset:8s} dp/tp: " + ", ".join(f"{k} {report.fmt_ratio(v)}" for k, v in ratios[preset].items()))
    out = {
        "bench": "dp_attention",
        "started": report.now_iso(),
        "args": {k: str(v) for k, v in vars(a).items()},
        "rows": rows,
        "dp_over_tp": ratios,
    }
    report.write_json(out, a.out)
    plt = report.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    groups = a.presets.split(",")

    def value(preset, layout, key):
        return next((r[key] for r in rows if r["preset"] == preset and r["layout"] == layout), None)

    names = {"tp": f"TP attention ({a.size} ranks)", "dp": f"DP attention ({a.size} ranks)"}
    report.grouped_bars(
        ax1,
        groups,
        {names[k]: [value(p, k, "kv_tokens") for p in groups] for k in ("tp", "dp")},
        f"KV tokens held at fixed memory (weights {a.weights_share:.0%} of a TP rank)",
        "tokens",
    )
    report.grouped_bars(
        ax2,
        groups,
        {
            **{f"{names[k]}, its full batch": [value(p, k, "best_tok_s") for p in groups] for k in ("tp", "dp")},
            f"{names['dp']}, TP's batch": [(value(p, "dp", "at_tp_batch") or {}).get("best_tok_s") for p in groups],
        },
        "Generation tokens/s (CPU, gloo; noisy shared cores)",
        "tokens / s",
    )
    fig.tight_layout()
    fig.savefig(a.out.with_suffix(".png"), dpi=110)
    print(f"wrote {a.out} and {a.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
