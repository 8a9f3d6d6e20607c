"""`dsv4 bench pd`: prefill/decode disaggregation (router + prefill + decode, KV over NIXL) vs one
monolithic engine, on the same checkpoint and prompts, at concurrency 8 and 32.

Per side: output tok/s, TTFT p50/p99, inter-token p50 (streaming client, best of --repeats;
sides take turns run by run). For PD, what the KV hand-off adds to TTFT, from both engines'
metrics over the same run: decode's TTFT mean - prefill's TTFT mean (the router starts both
clocks at once; prefill's stops at its first token, decode's when KV + token have landed),
over the client's TTFT mean. Beside it: prefill's dsv4:kv_transfer_latency_seconds (NIXL write
start -> DONE seen by prefill's loop: an upper bound, since the loop looks only between forward
steps), the bytes per request, and mono behind the same router (to tell the router hop from
PD). Target (issue 3, mla512): the hand-off adds <= 10% to TTFT. Writes OUT/pd.json, OUT/pd.png.

DeepSeek-V4 checkpoints (--preset v4-tiny / v4-flash-shape, or --model V4DIR) move paged states
(compressed entries, indexer keys) and one slot row per request (window ring, compressor
stages): the report gives the bytes moved per request and per prompt token by state, from
prefill's /v1/loads. --transfer-checksum runs PD with region checksums on and reports what
they cost per transfer on each side.

    python -m bench.suites.pd_bench [--preset mla512|v4-tiny|v4-flash-shape] [--concurrency 8,32] [--repeats 2]
                             [--transfer-checksum] [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import httpx
from rich.console import Console
from rich.table import Table

from bench.harness import prom
from bench.harness.checkpoints import RESULTS, ensure_model, model_facts
from bench.harness.http_side import Side, build_workloads, describe, drive
from bench.harness.procs import Server, free_port
from bench.harness.report import fmt, fmt_ratio, grouped_bars, machine, now_iso, pyplot, ratio, target, write_json

console = Console(width=None if sys.stdout.isatty() else 180)
TARGET_TRANSFER_SHARE = 0.10
LATENCY = "dsv4:kv_transfer_latency_seconds"
TTFT = "dsv4:time_to_first_token_seconds"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="checkpoint folder (default: made from --preset)")
    p.add_argument("--preset", default=None, help="preset for the default model (mla512; tiny with --quick)")
    p.add_argument("--concurrency", default=None, help="comma-separated levels (default 8,32)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128)")
    p.add_argument("--new-tokens", type=int, default=None, help="output tokens per request (default 64)")
    p.add_argument("--requests-per-client", type=int, default=None, help="requests each client sends (default 2)")
    p.add_argument("--repeats", type=int, default=None, help="runs per workload; the best counts (default 2)")
    p.add_argument("--kv-pages", type=int, default=None, help="KV pool of every engine, in pages (default 2048)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--page-size", type=int, default=None, help="tokens per KV page of every engine (default: the engine's)"
    )
    p.add_argument(
        "--transfer-checksum",
        action="store_true",
        help="PD engines checksum every state region of a hand-off (decode verifies); reports its cost",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument(
        "--pd-threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS of the prefill and decode engines (default: torch's, i.e. all cores each)",
    )
    p.add_argument(
        "--mono-via-router",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run mono behind the router, to separate the router hop from PD (default on; off with --quick)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results folder (default bench/results; bench/results/quick with --quick)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes for a smoke run")
    a = p.parse_args(argv)
    full = dict(
        preset="mla512",
        concurrency="8,32",
        prompt_len=128,
        new_tokens=64,
        requests_per_client=2,
        repeats=2,
        kv_pages=2048,
        mono_via_router=True,
    )
    quick = dict(
        preset="tiny",
        concurrency="2",
        prompt_len=16,
        new_tokens=4,
        requests_per_client=1,
        repeats=1,
        kv_pages=128,
        mono_via_router=False,
    )
    for k, v in (quick if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.concurrency = [int(x) for x in str(a.concurrency).split(",") if x]
    if a.out is None:
        a.out = RESULTS / "quick" if a.quick else RESULTS
    return a


class Deployment:
    """mono engine, prefill + decode engines, the PD router (and a router in front of mono):
    all started at once so their start-up overlaps, stopped together."""

    def __init__(self, model: Path, a: argparse.Namespace, logs: Path):
        common = [
            "--model",
            model,
            "--kv-pages",
            a.kv_pages,
            "--max-num-seqs",
            a.max_num_seqs,
            *(["--page-size", a.page_size] if a.page_size else []),
            "--max-num-batched-tokens",
            a.max_num_batched_tokens,
            "--served-model-name",
            "bench",
        ]
        pd_args = ["--transfer-checksum"] if a.transfer_checksum else []
        pd_env = {"OMP_NUM_THREADS": str(a.pd_threads)} if a.pd_threads else None
        ports = {k: free_port() for k in ("mono", "prefill", "bootstrap", "decode", "router", "mono_router")}
        self.servers: list[Server] = []

        def start(name, args, port, env=None) -> Server:
            s = Server.dsv4(name, args, port, logs, env)
            self.servers.append(s)
            return s

        self.mono = start("mono", ["serve", *common, "--role", "mono", "--port", ports["mono"]], ports["mono"])
        self.prefill = start(
            "prefill",
            [
                "serve",
                *common,
                *pd_args,
                "--role",
                "prefill",
                "--port",
                ports["prefill"],
                "--bootstrap-port",
                ports["bootstrap"],
            ],
            ports["prefill"],
            pd_env,
        )
        self.decode = start(
            "decode",
            ["serve", *common, *pd_args, "--role", "decode", "--port", ports["decode"]],
            ports["decode"],
            pd_env,
        )
        self.router = start(
            "router",
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
            ],
            ports["router"],
        )
        self.mono_router = None
        if a.mono_via_router:
            self.mono_router = start(
                "mono-router",
                ["router", "--mono", self.mono.url, "--port", ports["mono_router"], "--health-interval", "1"],
                ports["mono_router"],
            )

    def wait_ready(self, timeout: float = 240.0) -> None:
        for s in self.servers:
            s.wait_ready(timeout)

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


def mean_ms(before: str, after: str, name: str) -> tuple[Optional[float], int]:
    d = prom.histogram_delta(prom.histogram(before, name), prom.histogram(after, name))
    return (round(d["sum"] / d["count"] * 1000, 3) if d["count"] else None), int(d["count"])


def loads(url: str) -> dict:
    return httpx.get(f"{url}/v1/loads", timeout=10).json()


def state_stats(before: dict[str, dict], after: dict[str, dict], transfers: int, prompt_tokens: float) -> dict:
    """Bytes moved by state (prefill's /v1/loads), per transfer and per prompt token, and what
    the checksums cost per transfer on each side (0 when off)."""
    b, a = (
        before["prefill"].get("kv_transfer_bytes_by_state", {}),
        after["prefill"].get("kv_transfer_bytes_by_state", {}),
    )
    moved = {name: a[name] - b.get(name, 0) for name in a}
    out = {
        "bytes_by_state": moved,
        "bytes_per_transfer_by_state": {k: round(v / transfers) for k, v in moved.items()} if transfers else None,
        "bytes_per_prompt_token_by_state": {k: round(v / prompt_tokens, 1) for k, v in moved.items()}
        if prompt_tokens
        else None,
        "checksum_ms_per_transfer": {},
    }
    for role in ("prefill", "decode"):
        spent = after[role].get("transfer_checksum_seconds", 0.0) - before[role].get("transfer_checksum_seconds", 0.0)
        out["checksum_ms_per_transfer"][role] = round(spent / transfers * 1000, 4) if transfers else None
    return out


def transfer_stats(before: dict[str, str], after: dict[str, str]) -> dict:
    """What the KV hand-off cost during one run, from both engines' metrics.

    The router sends each request to prefill and decode at once, so both engines' TTFT clocks
    start together: prefill's stops when it has computed the first token (and starts the KV
    write), decode's when the KV and that token have landed and decode took them. The
    difference of the means is what the hand-off (NIXL write + notification + decode noticing
    it) adds to TTFT. Prefill's kv_transfer_latency (write start -> DONE seen by prefill's loop)
    also counts the prefill loop's forward steps it waited behind: an upper bound."""
    out: dict = {}
    for role in ("prefill", "decode"):
        d = prom.histogram_delta(prom.histogram(before[role], LATENCY), prom.histogram(after[role], LATENCY))
        n = d["count"]
        ttft, _ = mean_ms(before[role], after[role], TTFT)
        out[role] = {
            "transfers": int(n),
            "latency_mean_ms": round(d["sum"] / n * 1000, 3) if n else None,
            "latency_p50_ms_from_buckets": None if not n else round(prom.bucket_quantile(d["buckets"], 0.5) * 1000, 3),
            "engine_ttft_mean_ms": ttft,
        }
    p_ttft, d_ttft = out["prefill"]["engine_ttft_mean_ms"], out["decode"]["engine_ttft_mean_ms"]
    out["handoff_mean_ms"] = None if p_ttft is None or d_ttft is None else round(d_ttft - p_ttft, 3)
    moved = prom.counter(after["prefill"], "dsv4:kv_transfer_bytes_total") - prom.counter(
        before["prefill"], "dsv4:kv_transfer_bytes_total"
    )
    out["bytes"] = int(moved)
    p = out["prefill"]
    out["bytes_per_transfer"] = int(moved / p["transfers"]) if p["transfers"] else None
    return out


def pd_side(dep: Deployment) -> Side:
    """The PD pair behind its router, each run wrapped by scrapes of both engines' metrics."""
    urls = {"prefill": dep.prefill.url, "decode": dep.decode.url}

    def around(_name: str, run) -> dict:
        before = {r: prom.scrape(u) for r, u in urls.items()}
        loads_before = {r: loads(u) for r, u in urls.items()}
        summary = run()
        after = {r: prom.scrape(u) for r, u in urls.items()}
        loads_after = {r: loads(u) for r, u in urls.items()}
        summary["transfer"] = t = transfer_stats(before, after)
        prompt_tokens = prom.counter(after["prefill"], "dsv4:prompt_tokens_total") - prom.counter(
            before["prefill"], "dsv4:prompt_tokens_total"
        )
        t.update(state_stats(loads_before, loads_after, t["prefill"]["transfers"], prompt_tokens))
        summary["handoff_share_of_ttft"] = ratio(t["handoff_mean_ms"], summary["ttft_mean_ms"])
        summary["prefill_transfer_latency_share_of_ttft_p50"] = ratio(
            t["prefill"]["latency_mean_ms"], summary["ttft_p50_ms"]
        )
        return summary

    return Side("pd", dep.router.url, "bench", around)


def compare(report: dict) -> tuple[dict, list[dict]]:
    comparison, targets = {}, []
    for w in report["workloads"]:
        n = w["name"]
        mono, pd = report["mono"].get(n, {}), report["pd"].get(n, {})
        via = (report.get("mono_via_router") or {}).get(n, {})
        comparison[n] = {
            "pd_over_mono_tok_s": ratio(pd.get("output_tok_s"), mono.get("output_tok_s")),
            "ttft_p50_pd_over_mono": ratio(pd.get("ttft_p50_ms"), mono.get("ttft_p50_ms")),
            "ttft_p50_pd_over_mono_via_router": ratio(pd.get("ttft_p50_ms"), via.get("ttft_p50_ms")),
            "handoff_share_of_ttft": pd.get("handoff_share_of_ttft"),
            "prefill_transfer_latency_share_of_ttft_p50": pd.get("prefill_transfer_latency_share_of_ttft_p50"),
        }
        targets.append(
            target(
                f"{n}: KV hand-off (decode TTFT - prefill TTFT, means) / PD TTFT mean",
                comparison[n]["handoff_share_of_ttft"],
                TARGET_TRANSFER_SHARE,
                higher_better=False,
            )
        )
    return comparison, targets


def print_tables(report: dict) -> None:
    t = Table(
        title=f"dsv4 bench pd — {Path(report['model']['dir']).name}, best of {report['settings']['repeats']} "
        f"(load avg {report['machine']['load_average_start'][0]} at start)"
    )
    for col in (
        "workload",
        "side",
        "tok/s",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "hand-off mean",
        "hand-off / TTFT",
        "prefill xfer latency (upper bd)",
        "KiB/transfer",
        "PD/mono tok/s",
        "TTFT PD/mono",
    ):
        t.add_column(col, justify="right")
    sides = [("mono", report["mono"]), ("mono via router", report.get("mono_via_router") or {}), ("pd", report["pd"])]
    for w in report["workloads"]:
        n, c = w["name"], report["comparison"][w["name"]]
        for label, side in sides:
            s = side.get(n)
            if not s:
                continue
            tr = s.get("transfer") or {}
            is_pd = label == "pd"
            t.add_row(
                n,
                label,
                fmt(s["output_tok_s"]),
                fmt(s["ttft_p50_ms"], " ms"),
                fmt(s["ttft_p99_ms"], " ms"),
                fmt(s["itl_p50_ms"], " ms", 2),
                fmt(tr.get("handoff_mean_ms"), " ms", 2),
                fmt_ratio(c["handoff_share_of_ttft"], TARGET_TRANSFER_SHARE, higher_better=False) if is_pd else "",
                fmt((tr.get("prefill") or {}).get("latency_mean_ms"), " ms", 2),
                fmt(None if tr.get("bytes_per_transfer") is None else tr["bytes_per_transfer"] / 1024.0)
                if is_pd
                else "",
                fmt_ratio(c["pd_over_mono_tok_s"]) if is_pd else "",
                fmt_ratio(c["ttft_p50_pd_over_mono"]) if is_pd else "",
            )
    console.print(t)
    s = Table(title="KV hand-off by state (PD): bytes per request and per prompt token; checksum cost per transfer")
    for col in ("workload", "state", "B/request", "B/prompt token"):
        s.add_column(col, justify="right")
    for w in report["workloads"]:
        tr = (report["pd"].get(w["name"]) or {}).get("transfer") or {}
        per_req, per_tok = tr.get("bytes_per_transfer_by_state") or {}, tr.get("bytes_per_prompt_token_by_state") or {}
        for name in per_req:
            s.add_row(w["name"], name, fmt(per_req[name]), fmt(per_tok.get(name)))
        ck = tr.get("checksum_ms_per_transfer") or {}
        if report["settings"].get("transfer_checksum"):
            s.add_row(
                w["name"],
                "checksum ms/transfer",
                f"prefill {fmt(ck.get('prefill'), digits=3)}",
                f"decode {fmt(ck.get('decode'), digits=3)}",
            )
    console.print(s)
    for tg in report["targets"]:
        mark = (
            "[green]met[/green]" if tg["met"] else "[red]missed[/red]" if tg["met"] is False else "[yellow]n/a[/yellow]"
        )
        console.print(f"target {tg['name']} {tg['target']}: {fmt(tg['value'], digits=3)} -> {mark}")


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    names = [w["name"] for w in report["workloads"]]
    sides = {"mono": report["mono"], "mono via router": report.get("mono_via_router") or {}, "pd": report["pd"]}
    sides = {k: v for k, v in sides.items() if v}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    grouped_bars(
        axes[0],
        names,
        {k: [(s.get(n) or {}).get("output_tok_s") for n in names] for k, s in sides.items()},
        "output tokens/s",
        "tok/s",
    )
    grouped_bars(
        axes[1],
        names,
        {k: [(s.get(n) or {}).get("ttft_p50_ms") for n in names] for k, s in sides.items()},
        "TTFT p50 (lower is better)",
        "ms",
    )
    share = [report["comparison"][n]["handoff_share_of_ttft"] for n in names]
    upper = [report["comparison"][n]["prefill_transfer_latency_share_of_ttft_p50"] for n in names]
    grouped_bars(
        axes[2],
        names,
        {
            "hand-off / TTFT": [None if x is None else x * 100 for x in share],
            "prefill xfer latency / TTFT p50 (upper bound)": [None if x is None else x * 100 for x in upper],
        },
        f"KV hand-off share of PD TTFT (target <= {TARGET_TRANSFER_SHARE:.0%})",
        "%",
    )
    axes[2].axhline(TARGET_TRANSFER_SHARE * 100, color="red", linestyle="--", linewidth=1)
    fig.suptitle(
        f"dsv4 bench pd — {Path(report['model']['dir']).name}; load avg {report['machine']['load_average_start'][0]}",
        fontsize=11,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(argv)
    model = ensure_model(a.model, a.preset, a.seed)
    facts = model_facts(model, a.kv_pages, a.page_size, max_num_seqs=a.max_num_seqs)
    workloads = build_workloads(
        a.concurrency, a.requests_per_client, a.prompt_len, a.new_tokens, facts["vocab_size"], a.seed
    )
    a.out.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "benchmark": "pd",
        "started": now_iso(),
        "quick": a.quick,
        "machine": machine(),
        "model": facts,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "workloads": [describe(w) for w in workloads],
    }
    console.print(
        f"[bold]dsv4 bench pd[/bold]: {model} | workloads {', '.join(w['name'] for w in workloads)} | "
        f"load avg {report['machine']['load_average_start']}"
    )
    dep = Deployment(model, a, a.out / "logs" / "pd")
    try:
        dep.wait_ready()
        sides = [Side("mono", dep.mono.url, "bench")]
        if dep.mono_router is not None:
            sides.append(Side("mono_via_router", dep.mono_router.url, "bench"))
        sides.append(pd_side(dep))
        report.update(drive(sides, workloads, a.repeats, console))
    finally:
        dep.stop()
    report["comparison"], report["targets"] = compare(report)
    write_json(report, a.out / "pd.json")
    plot(report, a.out / "pd.png")
    print_tables(report)
    console.print(
        f"wrote {a.out / 'pd.json'} and {a.out / 'pd.png'} (load avg at end {report['machine']['load_average_end']})"
    )
    errors = sum(s.get("errors", 0) for side in ("mono", "pd") for s in report[side].values())
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
