"""`dsv4 bench agentperf`: the headline figure, in the shape of Artificial Analysis' AgentPerf: the
most agents a deployment holds at once while every round's TTFT p95 and output speed stay within a
declared tier, mono vs PD, before and after issue 41's work.

Each agent runs --rounds rounds through completions with token ids, streamed: round r+1's prompt
is round r's prompt + its answer's ids + a tool result of --tool-tokens fresh tokens, after a tool
pause of --pause seconds (uniform in the range); every agent shares a --system-tokens system
prefix. Per side, --levels agent counts run one after another, each on its own agents; a level is
held when over all its rounds TTFT p95 <= --tier-ttft-s and the 5th percentile of per-round output
speed (tokens after the first / their time) >= --tier-tok-s. The headline per side is the largest
level held (levels after the first one that fails are not run).

Sides (servers from `kv_continuity.start`): `mono`, `pd` (this release's defaults: decode serves a
conversation's next round itself), and `mono-before` / `pd-before` (`--decode-local-prefill 0
--chat-answer-memo 0`: every PD round is prefilled on prefill, the previous answer again, and the
whole conversation shipped to decode).

Writes OUT/agentperf.json and OUT/agentperf.png (default bench/results/agentperf/).

    python -m bench.suites.agentperf [--levels 1 2 4 8] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Optional

import httpx

from bench.harness.checkpoints import RESULTS, ensure_model
from bench.harness.report import machine, now_iso, pyplot, write_json
from bench.suites.kv_continuity import SIDES, moved_bytes, start


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=128)
    p.add_argument("--first-tokens", type=int, default=128, help="each agent's own first turn")
    p.add_argument("--answer-tokens", type=int, default=48)
    p.add_argument("--tool-tokens", type=int, default=96)
    p.add_argument("--pause", type=float, nargs=2, default=[0.5, 1.5], help="tool pause range, seconds")
    p.add_argument("--tier-ttft-s", type=float, default=2.0, help="the tier: TTFT p95 at most this")
    p.add_argument("--tier-tok-s", type=float, default=10.0, help="the tier: output speed p5 at least this")
    p.add_argument("--sides", nargs="+", default=["mono", "pd", "mono-before", "pd-before"], choices=list(SIDES))
    p.add_argument("--kv-pages", type=int, default=1024)
    p.add_argument("--out", type=Path, default=RESULTS / "agentperf")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="levels 1 2, 2 rounds, short answers")
    a = p.parse_args(argv)
    if a.quick:
        a.levels, a.rounds, a.answer_tokens, a.tool_tokens, a.pause = [1, 2], 2, 16, 32, [0.1, 0.2]
    return a


async def one_round(client: httpx.AsyncClient, url: str, prompt: list[int], n: int) -> dict:
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    ids, first, cached = [], None, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            for c in chunk.get("choices") or []:
                if c.get("token_ids"):
                    ids.extend(c["token_ids"])
                    first = first or time.perf_counter()
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    end = time.perf_counter()
    speed = (len(ids) - 1) / (end - first) if first and len(ids) > 1 and end > first else None
    return {"ids": ids, "ttft_s": (first or end) - t0, "tok_s": speed, "cached": cached, "prompt": len(prompt)}


async def level(url: str, agents: int, a: argparse.Namespace, seed: int) -> list[dict]:
    rng = random.Random(seed)
    system = [rng.randrange(5, 250) for _ in range(a.system_tokens)]
    rounds: list[dict] = []
    async with httpx.AsyncClient(timeout=900) as client:

        async def agent(k: int) -> None:
            prompt = system + [rng.randrange(5, 250) for _ in range(a.first_tokens)]
            for r in range(a.rounds):
                got = await one_round(client, url, prompt, a.answer_tokens)
                got["round"] = r
                rounds.append(got)
                if r + 1 < a.rounds:
                    await asyncio.sleep(rng.uniform(*a.pause))  # the tool runs
                    prompt = prompt + got["ids"] + [rng.randrange(5, 250) for _ in range(a.tool_tokens)]

        await asyncio.gather(*(agent(k) for k in range(agents)))
    return rounds


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def figures(rounds: list[dict], a: argparse.Namespace) -> dict:
    ttft = [r["ttft_s"] for r in rounds]
    speed = [r["tok_s"] for r in rounds if r["tok_s"] is not None]
    later = [r for r in rounds if r["round"] > 0]
    out = {
        "rounds": len(rounds),
        "ttft_p50_s": round(statistics.median(ttft), 3),
        "ttft_p95_s": round(pct(ttft, 0.95), 3),
        "tok_s_p50": round(statistics.median(speed), 2) if speed else None,
        "tok_s_p5": round(pct(speed, 0.05), 2) if speed else None,
        "cached_share_later_rounds": round(sum(r["cached"] for r in later) / sum(r["prompt"] for r in later), 3)
        if later
        else None,
    }
    out["held"] = out["ttft_p95_s"] <= a.tier_ttft_s and (out["tok_s_p5"] or 0) >= a.tier_tok_s
    return out


def run_side(side: str, model: Path, a: argparse.Namespace, logs: Path) -> dict:
    url, servers, prefill = start(side, model, a, logs)
    try:
        servers[-1].wait_ready(300)
        levels, best = {}, 0
        with httpx.Client(timeout=30) as sync:
            for i, n in enumerate(a.levels):
                before = moved_bytes(sync, prefill)
                got = figures(asyncio.run(level(url, n, a, a.seed + 1000 * i)), a)
                got["kv_bytes_moved"] = moved_bytes(sync, prefill) - before
                levels[str(n)] = got
                print(side, n, json.dumps(got), flush=True)
                if not got["held"]:
                    break
                best = n
        return {"levels": levels, "max_agents_in_tier": best}
    finally:
        for s in reversed(servers):
            s.stop()


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for side, got in report["sides"].items():
        xs = [int(n) for n in got["levels"]]
        ax1.plot(xs, [v["ttft_p95_s"] for v in got["levels"].values()], "o-", label=side)
    ax1.axhline(report["tier"]["ttft_p95_s_max"], color="grey", ls="--", label="tier")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("agents at once")
    ax1.set_ylabel("TTFT p95 (s)")
    ax1.legend(fontsize=8)
    sides = list(report["sides"])
    ax2.bar(sides, [report["sides"][s]["max_agents_in_tier"] for s in sides], color="#4c72b0")
    ax2.set_title(
        f"most agents within the tier (TTFT p95 <= {report['tier']['ttft_p95_s_max']} s, "
        f">= {report['tier']['tok_s_p5_min']} tok/s)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(argv)
    model = ensure_model(None, a.preset, 0)
    a.out.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "bench": "agentperf",
        "started": now_iso(),
        "machine": machine(),
        "preset": a.preset,
        "workload": {
            k: getattr(a, k)
            for k in ("rounds", "system_tokens", "first_tokens", "answer_tokens", "tool_tokens", "pause", "levels")
        },
        "tier": {"ttft_p95_s_max": a.tier_ttft_s, "tok_s_p5_min": a.tier_tok_s},
        "sides": {},
    }
    for side in a.sides:
        report["sides"][side] = run_side(side, model, a, a.out / "logs")
    report["headline"] = {s: v["max_agents_in_tier"] for s, v in report["sides"].items()}
    write_json(report, a.out / "agentperf.json")
    plot(report, a.out / "agentperf.png")
    print("most agents within the tier:", json.dumps(report["headline"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
