"""How much concurrent PD streaming the router holds, before and after the router rework.

For each router (the code of a git ref, by default `main`'s, and this tree's) it starts real
prefill + decode engines on the tiny model and the router on 127.0.0.1, then sends storms of
concurrent streaming requests (some clients hang up mid-stream or while queued) at rising
concurrency. A level holds when no client sees a 5xx, an error event, a cut stream or a hang
(no answer within --client-deadline). The old router's run stops at its first failing level.
After each storm it measures recovery: seconds until the engines are idle and the router serves
a fresh request. For this tree it also kills the decode engine (kill -9) mid-stream and measures
how long until every client was told, the engine's restart, and service back after it.

    python -m bench.experiments.router_load [--levels 50,100,200,300,400] [--old-ref main] [--skip-old]

Prints a summary and writes bench/results/router_load.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from bench import ROOT


from bench.harness.pd_chaos import (  # noqa: E402
    PDStack,
    StormSpec,
    kill_decode_mid_stream,
    server_errors,
    storm,
    tally,
    wait_engines_idle,
    wait_service,
)


def extract_ref(ref: str, dest: Path) -> Path:
    """The router and CLI packages of `ref`, importable from `dest` (put first on PYTHONPATH)."""
    for pkg in ("dsv4_router", "dsv4_cli"):
        names = subprocess.run(
            ["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{ref}:engine/{pkg}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        (dest / pkg).mkdir(parents=True, exist_ok=True)
        for name in names:
            if name.endswith(".py"):
                src = subprocess.run(
                    ["git", "-C", str(ROOT), "show", f"{ref}:engine/{pkg}/{name}"],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                (dest / pkg / name).write_text(src)
    return dest


def settle(stack: PDStack, timeout: float) -> dict:
    """Recovery after a storm: engines idle, then service through the router (None = not in time)."""
    t0 = time.monotonic()
    out: dict = {}
    try:
        out["engines_idle_s"] = round(wait_engines_idle(stack.p_url, stack.d_url, timeout=timeout), 2)
    except TimeoutError:
        out["engines_idle_s"] = None
    try:
        wait_service(stack.r_url, timeout=max(1.0, timeout - (time.monotonic() - t0)))
        out["service_back_s"] = round(time.monotonic() - t0, 2)
    except TimeoutError:
        out["service_back_s"] = None
    return out


def run_levels(stack: PDStack, levels: list[int], args, stop_at_failure: bool) -> list[dict]:
    rows = []
    for n in levels:
        t0 = time.monotonic()
        outcomes = storm(
            stack.r_url, StormSpec(requests=n, max_tokens=args.max_tokens, seed=n, deadline_s=args.client_deadline)
        )
        row = {
            "concurrency": n,
            "storm_s": round(time.monotonic() - t0, 1),
            **tally(outcomes),
            "failed": len(server_errors(outcomes)),
        }
        row["holds"] = row["failed"] == 0
        row.update(settle(stack, args.recovery_timeout))
        print(
            f"  {n:5d} concurrent: {'holds' if row['holds'] else 'FAILS'}  {row['outcomes']}  "
            f"storm {row['storm_s']}s  recovery {row['service_back_s']}s",
            flush=True,
        )
        rows.append(row)
        if stop_at_failure and not row["holds"]:
            break
    return rows


def held(rows: list[dict]) -> int:
    """Highest level held with every lower level held too."""
    best = 0
    for r in rows:
        if not r["holds"]:
            break
        best = r["concurrency"]
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="50,100,150,200,300,400")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--client-deadline", type=float, default=45.0, help="a client without an answer by then hangs")
    ap.add_argument("--recovery-timeout", type=float, default=120.0)
    ap.add_argument(
        "--waiting-timeout",
        type=float,
        default=10.0,
        help="the engines' KV waiting deadline (how long a request may queue behind the prefill; "
        "the same for both routers)",
    )
    ap.add_argument(
        "--old-ref",
        default=None,
        help="git ref of the router before (default: where this branch left main; its router is main's)",
    )
    ap.add_argument("--skip-old", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "router_load.json")
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG beside --out from its JSON")
    args = ap.parse_args()
    if args.plot_only:
        print(f"wrote {plot(json.loads(args.out.read_text()), args.out.with_suffix('.png'))}")
        return
    levels = [int(x) for x in args.levels.split(",")]
    engine_args = ["--waiting-timeout", args.waiting_timeout]

    tmp = Path(tempfile.mkdtemp(prefix="router-load-"))
    model = tmp / "tiny"
    subprocess.run(
        [sys.executable, "-m", "dsv4_cli", "model", "init", str(model), "--preset", "tiny"],
        check=True,
        capture_output=True,
    )
    # the CLI's default health interval (2 s), as a user running `dsv4 router` would have it
    result: dict = {
        "levels": levels,
        "max_tokens": args.max_tokens,
        "client_deadline_s": args.client_deadline,
        "engine_waiting_timeout_s": args.waiting_timeout,
        "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }

    if not args.skip_old:
        if args.old_ref is None:
            args.old_ref = subprocess.run(
                ["git", "-C", str(ROOT), "merge-base", "main", "HEAD"], check=True, capture_output=True, text=True
            ).stdout.strip()
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", args.old_ref], check=True, capture_output=True, text=True
        ).stdout.strip()
        print(f"before: router of {args.old_ref} ({commit})", flush=True)
        old_path = extract_ref(args.old_ref, tmp / "old")
        stack = PDStack(
            model, tmp / "old-run", router_python_path=str(old_path), health_interval=2.0, engine_args=engine_args
        )
        try:
            rows = run_levels(stack, levels, args, stop_at_failure=True)
        finally:
            stack.stop()
        result["before"] = {"ref": args.old_ref, "commit": commit, "holds_up_to": held(rows), "runs": rows}

    print("after: this tree's router", flush=True)
    stack = PDStack(model, tmp / "new-run", health_interval=2.0, pd_secret="bench-secret", engine_args=engine_args)
    try:
        rows = run_levels(stack, levels, args, stop_at_failure=False)
        result["after"] = {"holds_up_to": held(rows), "runs": rows}
        figures, _ = kill_decode_mid_stream(stack, requests=32, seed=7, recovery_s=60)
        result["after"]["kill_decode"] = figures
        print(f"  kill -9 decode mid-stream: {figures}", flush=True)
    finally:
        stack.stop()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    b, a = result.get("before", {}), result["after"]
    print(
        f"\nPD holds: before {b.get('holds_up_to', '-')} concurrent, after {a['holds_up_to']} "
        f"(highest level tried {max(levels)}); recovery after the largest storm "
        f"{a['runs'][-1]['service_back_s']}s; after kill -9 of decode: clients told in "
        f"{a['kill_decode']['clients_told_s']}s, service back {a['kill_decode']['service_back_after_ready_s']}s "
        f"after the restarted engine is ready ({a['kill_decode']['decode_restart_s']}s to restart)"
    )
    print(f"wrote {args.out} and {plot(result, args.out.with_suffix('.png'))}")


def plot(result: dict, png: Path) -> Path:
    """Share of requests served (of those whose client stayed) and time back to service, per
    concurrency level, for the router before and after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for side, colour in (("before", "tab:red"), ("after", "tab:blue")):
        runs = result.get(side, {}).get("runs", [])
        if not runs:
            continue
        xs = [r["concurrency"] for r in runs]
        served = [r["outcomes"].get("ok", 0) / max(1, r["requests"] - r["outcomes"].get("left", 0)) for r in runs]
        ax1.plot(xs, served, "o-", color=colour, label=f"{side} (holds up to {result[side]['holds_up_to']})")
        ax2.plot(xs, [r["service_back_s"] for r in runs], "o-", color=colour, label=side)
    ax1.set(
        xlabel="concurrent PD streams",
        ylabel="served / requests whose client stayed",
        ylim=(0, 1.05),
        title="PD through the router",
    )
    ax2.set(xlabel="concurrent PD streams", ylabel="seconds", title="back to service after the load")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"tiny model, {result['max_tokens']} tokens per request, {result['machine']['cpus']} cores")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    return png


if __name__ == "__main__":
    main()
