"""`dsv4 bench frameworks`: agent frameworks' own tool-call loops against a real `dsv4 up` (router
+ prefill + decode, KV over NIXL) on a tiny checkpoint (V4 DSML calls by default): the OpenAI
Agents SDK (its Runner over the Responses API), instructor (TOOLS mode, a nested model) and
LangChain (`bind_tools` over several rounds with ToolMessages), each streamed and not, with
`tool_choice` as the framework sends it.

The frameworks are no dependency of dsv4 (their pins clash with ours: instructor 1.17 wants
`jiter<0.15`, the Agents SDK an older `openai`): they run in the interpreter given by `--python`
(default $DSV4_FRAMEWORKS_PYTHON, else this one), one child process per loop
(bench/harness/framework_loops.py, which imports nothing of dsv4). A framework that interpreter
cannot import is reported as skipped, with the reason.

Random weights rarely open a call on their own: the loops send a logit bias toward the tokens
that open one (`--marker-bias 0` turns it off), as `dsv4 bench agents` does. Reported per
framework and side: rounds, calls made and parsed by the framework, malformed calls (the
framework could not parse or validate one), other errors. Writes OUT/frameworks.json and
OUT/frameworks.png.

    python -m bench.suites.frameworks_bench [--preset v4-tiny] [--rounds 4] [--python PATH] [--mono]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

import httpx

from bench.harness.checkpoints import RESULTS, ensure_model
from dsv4_wire import switches
from bench.harness.procs import Server
from bench.harness.commands import free_port_block
from bench.harness.report import grouped_bars, machine, now_iso, pyplot, write_json
from bench.suites.agents_bench import long_context, marker_bias

LOOPS = Path(__file__).resolve().parent.parent / "harness" / "framework_loops.py"
# framework -> the module its loop imports (what --python must have)
FRAMEWORKS = {"agents-sdk": "agents", "instructor": "instructor", "langchain": "langchain_openai"}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="v4-tiny", help="checkpoint preset (default v4-tiny: DSML calls)")
    p.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=list(FRAMEWORKS))
    p.add_argument("--rounds", type=int, default=4, help="tool rounds per framework and side")
    p.add_argument(
        "--max-tokens", type=int, default=400, help="answer budget per round (instructor's nested V4 call: ~250)"
    )
    p.add_argument("--python", default=switches.read("DSV4_FRAMEWORKS_PYTHON") or sys.executable)
    p.add_argument("--mono", action="store_true", help="dsv4 up --mono (one engine behind the router) instead of PD")
    p.add_argument("--marker-bias", type=float, default=4.0, help="logit bias toward the call-opening tokens")
    p.add_argument("--timeout", type=float, default=600, help="seconds per framework loop")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "frameworks")
    return p.parse_args(argv)


def importable(python: str, module: str) -> Optional[str]:
    """None when `python` imports `module`, else why not (one line)."""
    r = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    if r.returncode == 0:
        return None
    last = (r.stderr.strip().splitlines() or ["failed"])[-1]
    return f"{python} cannot import {module}: {last}"


def run_loop(a: argparse.Namespace, framework: str, url: str, model: str, bias: dict, stream: bool) -> dict:
    argv = [a.python, str(LOOPS), framework, "--base-url", f"{url}/v1", "--model", model]
    argv += ["--rounds", str(a.rounds), "--max-tokens", str(a.max_tokens), "--bias", json.dumps(bias)]
    argv += ["--stream"] if stream else []
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return {"framework": framework, "stream": stream, "errors": [f"timed out after {a.timeout:.0f} s"]}
    lines = r.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        return {"framework": framework, "stream": stream, "errors": [f"exit {r.returncode}: {r.stderr[-600:]}"]}


def verdict(res: dict) -> dict:
    """Success: every round ran, calls were made and parsed, none malformed, no other error."""
    ok = res.get("rounds") and res.get("calls") and not res.get("malformed") and not res.get("errors")
    return {**res, "success": bool(ok)}


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    rows = [r for r in report["runs"] if "skipped" not in r]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['framework']}\n{'stream' if r['stream'] else 'whole'}" for r in rows]
    series = {k: [r.get(k, 0) or 0 for r in rows] for k in ("rounds", "calls", "malformed")}
    series["errors"] = [len(r.get("errors") or []) for r in rows]
    grouped_bars(
        ax,
        labels,
        series,
        f"Frameworks' tool loops on {report['deployment']} ({report['config']['preset']})",
        "count",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Optional[list[str]] = None) -> None:
    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "frameworks",
        "started": now_iso(),
        "machine": machine(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "deployment": "dsv4 up --mono" if a.mono else "dsv4 up (router + prefill + decode)",
        "note": "random-weight checkpoint with a logit bias toward call markers: this checks that calls are made "
        "and parsed by each framework, not the model's choices",
        "runs": [],
    }
    runnable = []
    for fw in a.frameworks:
        why = importable(a.python, FRAMEWORKS[fw])
        if why is None:
            runnable.append(fw)
        else:
            report["runs"].append({"framework": fw, "skipped": why})
            print(f"{fw}: skipped ({why})", flush=True)
    if runnable:
        model_dir = long_context(ensure_model(None, a.preset, a.seed))
        bias = marker_bias(model_dir, a.marker_bias)
        port = free_port_block()
        args = ["up", "--model", model_dir, "--port", port, "--engine-arg", "--max-num-seqs=8"]
        args += ["--mono"] if a.mono else []
        up = Server.dsv4("dsv4-up", args, port, a.out / "logs")
        try:
            up.wait_ready(600)
            name = httpx.get(f"{up.url}/v1/models", timeout=30).json()["data"][0]["id"]
            for fw in runnable:
                for stream in (False, True):
                    res = verdict(run_loop(a, fw, up.url, name, bias, stream))
                    report["runs"].append(res)
                    write_json(report, a.out / "frameworks.json")
                    print(json.dumps(res)[:400], flush=True)
        finally:
            up.stop()
    write_json(report, a.out / "frameworks.json")
    plot(report, a.out / "frameworks.png")
    print(f"wrote {a.out / 'frameworks.json'} and {a.out / 'frameworks.png'}")


if __name__ == "__main__":
    sys.exit(main())
