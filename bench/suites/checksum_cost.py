"""`dsv4 bench checksum`: what `--transfer-checksum` costs a PD deployment at 32 streams (issue 45).

Two PD deployments (router + prefill + decode, KV over NIXL), the same checkpoint and prompts,
one with `--transfer-checksum` on both engines and one without; the sides take turns run by run
(bench.harness.http_side.drive, best of --repeats). Per side: output tok/s, TTFT and ITL; for
the checksummed side, the seconds the sums took per transfer on each engine (their /v1/loads).
The cost is the tok/s lost, and the decision rule of the issue: on by default when it is under
3%. Writes OUT/checksum.json and OUT/checksum.png.

    python -m bench.suites.checksum_cost [--preset mla512] [--concurrency 32] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import httpx
from rich.console import Console

from bench.harness.checkpoints import RESULTS, ensure_model, model_facts
from bench.harness.http_side import Side, build_workloads, describe, drive
from bench.harness.procs import Server, free_port
from bench.harness.report import grouped_bars, machine, now_iso, pyplot, write_json

console = Console(width=None if sys.stdout.isatty() else 160)
THRESHOLD = 0.03  # on by default below this share of throughput (issue 45)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="checkpoint folder (default: made from --preset)")
    p.add_argument("--preset", default="mla512", help="preset of the default model (the real MLA latent width)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-pages", type=int, default=2048)
    p.add_argument("--out", type=Path, default=RESULTS / "checksum")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes for a smoke run")
    a = p.parse_args(argv)
    if a.quick:
        a.preset, a.concurrency, a.prompt_len, a.new_tokens, a.repeats, a.kv_pages = "tiny", 2, 16, 4, 1, 128
        a.requests_per_client = 1
        a.out = RESULTS / "quick"
    return a


class PDDeployment:
    def __init__(self, name: str, model: Path, a: argparse.Namespace, logs: Path, extra: list[str]):
        common = ["--model", model, "--kv-pages", a.kv_pages, "--served-model-name", "bench", *extra]
        ports = {k: free_port() for k in ("prefill", "bootstrap", "decode", "router")}
        self.prefill = Server.dsv4(
            f"{name}-prefill",
            ["serve", *common, "--role", "prefill", "--port", ports["prefill"], "--bootstrap-port", ports["bootstrap"]],
            ports["prefill"],
            logs,
        )
        self.decode = Server.dsv4(
            f"{name}-decode", ["serve", *common, "--role", "decode", "--port", ports["decode"]], ports["decode"], logs
        )
        self.router = Server.dsv4(
            f"{name}-router",
            ["router", "--prefill", self.prefill.url, "--decode", self.decode.url, "--port", ports["router"]],
            ports["router"],
            logs,
        )
        self.servers = [self.prefill, self.decode, self.router]

    def wait_ready(self) -> None:
        for s in self.servers:
            s.wait_ready(240.0)

    def checksum_seconds(self) -> dict[str, float]:
        out = {}
        for role, s in (("prefill", self.prefill), ("decode", self.decode)):
            ld = httpx.get(s.url + "/v1/loads", timeout=10).json()
            out[role] = (
                float(ld.get("transfer_checksum_seconds") or 0.0),
                float(ld["counters"]["kv_transfers_completed"]),
            )
        return out

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


def cost(off: dict, on: dict) -> Optional[float]:
    """The share of throughput the checksum costs (negative: within noise, faster). Pure."""
    if not off.get("output_tok_s") or on.get("output_tok_s") is None:
        return None
    return round(1.0 - on["output_tok_s"] / off["output_tok_s"], 4)


def main(argv: Optional[list[str]] = None) -> dict:
    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    logs = a.out / "logs"
    logs.mkdir(exist_ok=True)
    model = ensure_model(a.model, a.preset, a.seed)
    facts = model_facts(model, a.kv_pages, None, max_num_seqs=64)
    workloads = build_workloads([a.concurrency], a.requests_per_client, a.prompt_len, a.new_tokens, 256, a.seed)
    off = PDDeployment("off", model, a, logs, [])
    on = PDDeployment("on", model, a, logs, ["--transfer-checksum"])
    try:
        for d in (off, on):
            d.wait_ready()
        before = on.checksum_seconds()
        sides = [Side("checksum_off", off.router.url, "bench"), Side("checksum_on", on.router.url, "bench")]
        results = drive(sides, workloads, a.repeats, console)
        after = on.checksum_seconds()
    finally:
        off.stop()
        on.stop()
    w = workloads[0]["name"]
    per_transfer = {}
    for role in ("prefill", "decode"):
        spent, n = after[role][0] - before[role][0], after[role][1] - before[role][1]
        per_transfer[role] = round(spent / n * 1000, 4) if n else None
    share = cost(results["checksum_off"][w], results["checksum_on"][w])
    report = {
        "suite": "checksum",
        "started": now_iso(),
        "model": facts,
        "workload": describe(workloads[0]),
        "repeats": a.repeats,
        "results": results,
        "checksum_ms_per_transfer": per_transfer,
        "throughput_cost_share": share,
        "threshold": THRESHOLD,
        "decision": "on by default" if share is not None and share < THRESHOLD else "off by default",
        "machine": machine(),
        "note": "2 shared cores; best of the repeats per side, sides taking turns: noisy, see runs_tok_s",
    }
    write_json(report, a.out / "checksum.json")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    title = f"--transfer-checksum at {a.concurrency} streams: cost {share:.1%}" if share is not None else ""
    series = {k: [results[k][w]["output_tok_s"]] for k in ("checksum_off", "checksum_on")}
    grouped_bars(ax, ["output tok/s (best run)"], series, title, "tok/s")
    fig.tight_layout()
    fig.savefig(a.out / "checksum.png")
    console.print(f"cost {share}, per transfer (ms): {per_transfer} -> {report['decision']}")
    return report


if __name__ == "__main__":
    main()
