"""What a migration costs a client: the added latency per migrated stream, at two concurrencies.

Real processes on 127.0.0.1 (tiny model): a prefill engine, two decode engines and the router.
Each round sends C concurrent greedy streams of --tokens tokens; once decode0 runs at least C/4
of them it is hit -- by `POST /admin/abort {"all": true}` (an engine_error migration; the engine
stays up, so rounds are cheap) or, in the last round of each level, by kill -9 (connection_lost;
decode0 is then restarted). A stream that moved is known by its id in the router's log line
"request ID: migrations=N". Its added latency is its longest pause between two events minus its
own median pause (what the move cost it); the undisturbed streams of the round give the same
figure for comparison (what batching jitter alone costs). Every client must end whole: any
error fails the run.

    python -m bench.suites.migration_latency [--levels 8,32] [--rounds 4] [--tokens 64]

Writes bench/results/migration_latency.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import re
import signal
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
from bench import RESULTS


from bench.harness.migration_chaos import Cluster  # noqa: E402


async def one(session: aiohttp.ClientSession, url: str, i: int, tokens: int) -> dict:
    body = {
        "prompt": [(7 * i + j) % 400 + 3 for j in range(8 + i % 9)],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.monotonic()
    times, rid, err, usage = [], None, None, None
    async with session.post(url + "/v1/completions", json=body) as r:
        buf = b""
        async for chunk in r.content.iter_any():
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                data = event[6:]
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    err = obj
                    continue
                rid = obj["id"]
                usage = obj.get("usage") or usage
                if obj["choices"]:
                    times.append(time.monotonic() - t0)
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {
        "id": rid,
        "error": err,
        "completion_tokens": (usage or {}).get("completion_tokens"),
        "ttft": times[0] if times else None,
        "max_gap": max(gaps) if gaps else 0.0,
        "median_gap": statistics.median(gaps) if gaps else 0.0,
        "e2e": time.monotonic() - t0,
    }


async def round_(c: Cluster, conc: int, tokens: int, kill: bool) -> list[dict]:
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as s:
        jobs = asyncio.gather(*(one(s, c.r_url, i, tokens) for i in range(conc)))
        deadline = time.monotonic() + 60
        while await asyncio.to_thread(c.running, "decode0") < max(1, conc // 4):
            if time.monotonic() > deadline:
                raise TimeoutError(c.logs())
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # mid-stream
        if kill:
            c.kill("decode0", signal.SIGKILL)
        else:
            headers = {}
            await asyncio.to_thread(
                httpx.post,
                f"{c.urls['decode0']}/admin/abort",
                json={"all": True, "reason": "bench"},
                headers=headers,
                timeout=10,
            )
        return list(await jobs)


def moved_ids(log: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"request (\S+): migrations=(\d+)", log)}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="8,32")
    ap.add_argument(
        "--rounds", type=int, default=4, help="rounds per level; the last one kills (-9) instead of aborting"
    )
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=str(RESULTS / "migration_latency.json"))
    args = ap.parse_args()
    from dsv4_engine.checkpoint import init_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="migbench-"))
    model = tmp / "tiny"
    init_checkpoint(model, preset="tiny", seed=0)
    c = Cluster(model, tmp, decodes=2)
    results = {"machine": platform.processor() or platform.machine(), "tokens": args.tokens, "levels": {}}
    try:
        for conc in [int(x) for x in args.levels.split(",")]:
            moved_cost, still_cost, kinds, moved_n, total = [], [], {}, 0, 0
            for r in range(args.rounds):
                kill = r == args.rounds - 1
                log_before = len(c.router.log_path.read_text(errors="replace"))
                outs = asyncio.run(round_(c, conc, args.tokens, kill))
                time.sleep(0.5)  # the router logs a moved request when its stream closes
                moved = moved_ids(c.router.log_path.read_text(errors="replace")[log_before:])
                bad = [o for o in outs if o["error"] or o["completion_tokens"] != args.tokens]
                if bad:
                    raise SystemExit(f"client errors at c{conc}: {bad[:3]}\n{c.logs()}")
                for o in outs:
                    total += 1
                    cost = o["max_gap"] - o["median_gap"]
                    if o["id"] in moved:
                        moved_n += 1
                        moved_cost.append(cost)
                        kinds.setdefault("kill" if kill else "abort", []).append(cost)
                    else:
                        still_cost.append(cost)
                if kill:
                    c.restart("decode0")
                    c.router.wait_workers_healthy(c.r_url, 3, timeout=60)
            results["levels"][f"c{conc}"] = {
                "streams": total,
                "migrated": moved_n,
                "migrated_share": round(moved_n / total, 3),
                "added_latency_s": {
                    "p50": pct(moved_cost, 0.5),
                    "p99": pct(moved_cost, 0.99),
                    "max": pct(moved_cost, 1.0),
                },
                "by_fault": {k: {"n": len(v), "p50": pct(v, 0.5), "p99": pct(v, 0.99)} for k, v in kinds.items()},
                "unmoved_longest_pause_s": {"p50": pct(still_cost, 0.5), "p99": pct(still_cost, 0.99)},
                "samples_migrated": [round(x, 3) for x in moved_cost],
            }
            print(f"c{conc}:", json.dumps(results["levels"][f"c{conc}"]), flush=True)
    finally:
        c.stop()
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    plot(results, Path(args.out).with_suffix(".png"))


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(results["levels"])
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(levels))
    for off, key, label in (
        (-0.2, "added_latency_s", "migrated streams"),
        (0.2, "unmoved_longest_pause_s", "undisturbed streams"),
    ):
        p50 = [results["levels"][lv][key]["p50"] or 0 for lv in levels]
        p99 = [results["levels"][lv][key]["p99"] or 0 for lv in levels]
        ax.bar([x + off for x in xs], p99, 0.35, alpha=0.35, label=f"{label} p99")
        ax.bar([x + off for x in xs], p50, 0.35, label=f"{label} p50")
    ax.set_xticks(list(xs), [f"{lv} ({results['levels'][lv]['migrated_share']:.0%} migrated)" for lv in levels])
    ax.set_ylabel("longest pause - median pause (s)")
    ax.set_title(
        f"Added latency per migration\n(tiny model, {results['tokens']}-token greedy streams, 2 decode engines)",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
