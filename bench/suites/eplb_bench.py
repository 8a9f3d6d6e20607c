"""`dsv4 bench eplb`: expert-parallel load balancing from loads recorded in a real run (issue 46).

On the `moe32` preset (32 routed experts, top-4, learned sigmoid routing, 3 MoE layers), or on
`v4-moe32` (DeepSeek-V4: 32 routed experts, top-4, one hash-routed and three learned
sqrt-softplus layers; `--preset v4-moe32`, written to OUT = bench/results/eplb-v4):
1. record: one engine (--tp-size 1) serves skewed prompts -- every prompt is drawn from a
   three-word vocabulary, so the router sees few distinct hidden states and a few experts take
   most tokens -- and its counters are saved (GET /admin/expert_loads -> loads.json);
2. plan: from those loads, the ranks' max/mean load under the plain block split and under EPLB
   with one redundant expert per rank (dsv4_engine.parallel.eplb, a pure function), for 2, 4 and
   8 ranks;
3. serve: the same prompts at --tp-size 2 (gloo) without EPLB, and with
   --ep-redundant-experts 2 --ep-loads-file loads.json; each rank's measured load from the
   engine's own counters, and the greedy text of every request compared with step 1's; during the
   EPLB run a rebalance from the live loads lands between two steps while requests run (none may
   fail, none may change).
The bar (max/mean per rank <= LIMIT with EPLB) is judged on the learned-routing layers; a
hash-routed layer (V4) is placed by the same balancer and reported beside them (its experts are
fixed by the token ids, so its skew is the prompts' token mix, not the router's).
Writes OUT/eplb.json and OUT/eplb.png.

    python -m bench.suites.eplb_bench [--preset moe32|v4-moe32] [--prompts 16] [--tp 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import httpx

from bench.harness.checkpoints import RESULTS, ensure_model
from bench.harness.commands import serving
from bench.harness.report import machine, now_iso, pyplot, write_json
from dsv4_engine.parallel import eplb

WORDS = ("yes", "no", "ok")
LIMIT = 1.10  # the bar for max/mean load per rank with EPLB


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="checkpoint folder (default: made from --preset)")
    p.add_argument("--preset", default="moe32")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-words", type=int, default=48)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--tp", type=int, default=2, help="ranks of the served runs (gloo on CPU)")
    p.add_argument("--out", type=Path, help="default: bench/results/eplb (moe32) or eplb-v4 (v4-moe32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    a = p.parse_args(argv)
    if a.quick:
        a.prompts, a.prompt_words, a.new_tokens = 4, 16, 4
        a.out = RESULTS / "quick"
    if a.out is None:
        a.out = RESULTS / ("eplb-v4" if a.preset.startswith("v4") else "eplb")
    return a


def skewed_prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


def complete(url: str, prompt: str, new_tokens: int) -> str:
    body = {"model": "m", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def run_all(url: str, prompts: list[str], new_tokens: int, during=None) -> list[str]:
    """Every prompt, 4 at a time; `during(url)` runs once the first requests are in flight."""
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(complete, url, p, new_tokens) for p in prompts]
        if during is not None:
            time.sleep(0.5)
            during(url)
        return [f.result() for f in futures]


def learned_worst(by_layer: dict[str, float], routing: dict[str, str]) -> float:
    """The worst figure over the learned-routing layers (the bar's); 1.0 when there is none."""
    return max((v for k, v in by_layer.items() if routing.get(k, "learned") == "learned"), default=1.0)


def live_balance(table: dict) -> dict[str, float]:
    """Layer -> max/mean of the tokens each rank computed (the engine's physical counters)."""
    return {layer: round(eplb.imbalance(row["ranks"]), 4) for layer, row in table["layers"].items()}


def main(argv: Optional[list[str]] = None) -> None:
    a = parse_args(argv)
    model = ensure_model(a.model, a.preset, a.seed)
    prompts = skewed_prompts(a.prompts, a.prompt_words, a.seed)
    a.out.mkdir(parents=True, exist_ok=True)
    logs = a.out / "logs"
    logs.mkdir(exist_ok=True)
    base = ["--model", model, "--kv-pages", 512, "--served-model-name", "m", "--device", "cpu"]
    started = now_iso()

    # 1. record
    with serving(base, logs / "record.log") as url:
        ref = run_all(url, prompts, a.new_tokens)
        table = httpx.get(url + "/admin/expert_loads").json()
    loads_path = a.out / "loads.json"
    loads_path.write_text(json.dumps(table, indent=1) + "\n")
    loads = {int(i): [float(n) for n in row["experts"]] for i, row in table["layers"].items()}
    routing = {i: row.get("routing", "learned") for i, row in table["layers"].items()}
    expert_skew = {str(i): round(eplb.imbalance(v), 3) for i, v in loads.items()}
    print(f"recorded {sum(sum(v) for v in loads.values()):.0f} expert choices; max/mean over experts {expert_skew}")

    # 2. plan, one redundant expert per rank
    planned = {}
    for ranks in (2, 4, 8):
        planned[str(ranks)] = eplb.report(loads, eplb.plan(loads, ranks, ranks))
        rows = planned[str(ranks)]["layers"]
        planned[str(ranks)]["worst_learned"] = {
            k: learned_worst({i: r[k] for i, r in rows.items()}, routing) for k in ("block", "eplb")
        }
        print(f"{ranks} ranks, {ranks} redundant: worst learned layer {planned[str(ranks)]['worst_learned']}")

    # 3. serve at --tp-size N without and with EPLB
    served = {}
    with serving([*base, "--tp-size", a.tp], logs / "tp.log") as url:
        texts = run_all(url, prompts, a.new_tokens)
        served["block"] = {"balance": live_balance(httpx.get(url + "/admin/expert_loads").json()), "same": texts == ref}
    rebalanced: dict = {}

    def rebalance(url: str) -> None:  # while run_all's requests are in flight
        r = httpx.post(url + "/admin/eplb/rebalance", timeout=300)
        rebalanced["status"] = r.status_code
        rebalanced["report"] = r.json().get("report")

    eplb_args = ["--tp-size", a.tp, "--ep-redundant-experts", a.tp, "--ep-loads-file", loads_path]
    with serving([*base, *eplb_args], logs / "tp-eplb.log") as url:
        texts = run_all(url, prompts, a.new_tokens)
        first = httpx.get(url + "/admin/expert_loads").json()
        served["eplb"] = {"balance": live_balance(first), "same": texts == ref, "placement": first["placement"]}
        again = run_all(url, prompts, a.new_tokens, during=rebalance)  # a live rebalance mid-run
        served["eplb_after_live_rebalance"] = {"same": again == ref, **rebalanced}
    worst = {k: learned_worst(v["balance"], routing) for k, v in served.items() if "balance" in v}
    hashed = [k for k, r in routing.items() if r == "hash"]
    report = {
        "suite": "eplb",
        "started": started,
        "model": str(model),
        "preset": a.preset,
        "skew": f"prompts drawn from the words {list(WORDS)} ({a.prompt_words} words each); random router weights",
        "prompts": a.prompts,
        "new_tokens": a.new_tokens,
        "expert_max_over_mean": expert_skew,
        "routing": routing,
        "hash_layers": {  # placed by the same balancer, not judged by the bar
            k: {
                "planned": {g: planned[g]["layers"][k] for g in planned},
                "served": {m: served[m]["balance"][k] for m in worst},
            }
            for k in hashed
        },
        "planned": planned,
        "served_tp": a.tp,
        "served": served,
        "served_worst": worst,  # over the learned-routing layers
        "limit": LIMIT,
        "pass": {
            "planned_8_ranks": planned["8"]["worst_learned"]["eplb"] <= LIMIT,
            "served": worst["eplb"] <= LIMIT,
            "output_unchanged": all(v.get("same") for v in served.values()),
        },
        "machine": machine(),
    }
    write_json(report, a.out / "eplb.json")
    plot(report, a.out / "eplb.png")
    print(json.dumps(report["pass"]), f"served worst {worst}")
    if not all(report["pass"].values()):
        sys.exit(1)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    groups = sorted(report["planned"], key=int)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    xs = range(len(groups))
    w = 0.38
    key = "worst_learned" if "worst_learned" in report["planned"][groups[0]] else "worst"
    block = [report["planned"][g][key]["block"] for g in groups]
    bal = [report["planned"][g][key]["eplb"] for g in groups]
    ax.bar([x - w / 2 for x in xs], block, w, label="block split")
    ax.bar([x + w / 2 for x in xs], bal, w, label="EPLB, 1 redundant / rank")
    for x, b, e in zip(xs, block, bal):
        ax.annotate(f"{b:.2f}", (x - w / 2, b), ha="center", va="bottom", fontsize=8)
        ax.annotate(f"{e:.2f}", (x + w / 2, e), ha="center", va="bottom", fontsize=8)
    ax.axhline(LIMIT, color="gray", linestyle="--", linewidth=1, label=f"{LIMIT}")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{g} ranks" for g in groups])
    ax.set_ylabel("max / mean load per rank (worst learned layer)")
    ax.set_title("Planned from recorded loads", fontsize=10)
    ax.legend(fontsize=8)
    ax = axes[1]
    served = report["served"]
    layers = sorted(served["block"]["balance"], key=int)
    xs = range(len(layers))
    ax.bar([x - w / 2 for x in xs], [served["block"]["balance"][k] for k in layers], w, label="block split")
    ax.bar([x + w / 2 for x in xs], [served["eplb"]["balance"][k] for k in layers], w, label="EPLB")
    ax.axhline(LIMIT, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks(list(xs))
    routing = report.get("routing", {})
    ax.set_xticklabels([f"layer {k}" + (" (hash)" if routing.get(k) == "hash" else "") for k in layers])
    ax.set_title(f"Measured at --tp-size {report['served_tp']} (engine counters)", fontsize=10)
    ax.legend(fontsize=8)
    fig.suptitle(f"EPLB on {report['preset']}: skewed prompts, greedy output unchanged", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
