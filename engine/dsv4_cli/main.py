"""The `dsv4` command line: one typer app; each command imports its implementation lazily so
that `dsv4 --help` stays fast and a command only pays for what it uses."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

# rich_markup_mode=None: a bad flag is click's plain "Error: ..." line, not a drawn box.
app = typer.Typer(
    rich_markup_mode=None,
    add_completion=False,
    no_args_is_help=True,
    help="dsv4: serve DeepSeek-style MoE models with prefill/decode disaggregation.",
)
model_app = typer.Typer(rich_markup_mode=None, no_args_is_help=True, help="Make and inspect model checkpoints.")
app.add_typer(model_app, name="model")
from dsv4_cli.bench import app as bench_app  # noqa: E402  (light: typer only)
from dsv4_wire import ADMIN_TOKEN_ENV, PD_SECRET_ENV, EngineFlags  # noqa: E402

app.add_typer(bench_app, name="bench")


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code=2)


def _check_model_dir(model: Path, quantization: bool = True) -> None:
    """quantization False: leave the quantization check to the caller (it imports torch, which
    `dsv4 serve`'s HTTP process never does: its engine core checks instead)."""
    if not (model / "config.json").is_file():
        _fail(f"no model at {model} (expected {model / 'config.json'}); make one with `dsv4 model init DIR`")
    from dsv4_engine.models import UnsupportedModel, entry_for_dir

    try:
        entry_for_dir(model)
    except UnsupportedModel as e:
        _fail(f"{model}: {e}")
    if quantization:
        from dsv4_engine.quant import UnsupportedQuantization, checkpoint_scheme

        try:
            checkpoint_scheme(model)
        except UnsupportedQuantization as e:
            _fail(f"{model}: {e}")


def _dsv4_command() -> list[str]:
    """How child processes start this same CLI (the interpreter we run under, not PATH's)."""
    return [sys.executable, "-m", "dsv4_cli"]


def _default_model() -> Path:
    """The tiny model, built once into the cache folder (what `dsv4 up` serves by default)."""
    from dsv4_operator.local import cache_dir

    from dsv4_wire.chat_tokens import TOOL_SEP

    out = cache_dir() / "models" / "tiny-0"
    tok = out / "tokenizer.json"
    # a cache from before the chat markers were added to the tokenizer is rebuilt (agents need them)
    if not (out / "config.json").exists() or not tok.is_file() or TOOL_SEP not in tok.read_text(encoding="utf-8"):
        from dsv4_engine.checkpoint import init_checkpoint

        typer.echo(f"dsv4 up: building the tiny model into {out}", err=True)
        init_checkpoint(out, preset="tiny", seed=0)
    return out


@model_app.command("init")
def model_init(
    out_dir: Path = typer.Argument(..., help="Folder to write the checkpoint into."),
    preset: str = typer.Option(
        "tiny", help="Model preset: tiny | mla512 (DeepSeek-V3) | v4-tiny | v4-flash-shape (DeepSeek-V4, release layout)."
    ),
    seed: int = typer.Option(0, help="Seed; the same seed writes the same checkpoint."),
    quant: Optional[str] = typer.Option(
        None, help="Quantize the linear weights: fp8 (block-scaled e4m3, any preset) | fp4-experts (V4 presets: "
        "fp4 routed experts, fp8 elsewhere, as DeepSeek-V4 ships)."
    ),
    mtp: bool = typer.Option(False, "--mtp", help="Add one multi-token-prediction layer (V3: model.layers.N, V4: mtp.0; "
                             "num_nextn_predict_layers: 1) for --speculative-algorithm mtp."),
    train_mtp: bool = typer.Option(False, "--train-mtp",
                                   help="Implies --mtp: self-distil the MTP layer (DeepSeek-V3 presets) on the model's own greedy "
                                        "continuations (a few CPU minutes) so that speculation accepts drafts."),
    train_steps: int = typer.Option(600, "--train-steps", min=1, help="Optimizer steps of --train-mtp."),
) -> None:
    """Write a Hugging Face-format DeepSeek-V3 or -V4 checkpoint (config, safetensors, tokenizer)."""
    from dsv4_engine.checkpoint import PRESETS, init_checkpoint

    if preset not in PRESETS:
        _fail(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    try:
        if train_mtp and quant:
            raise ValueError("--train-mtp trains float weights: write the checkpoint without --quant")
        if train_mtp and PRESETS[preset].get("model_type") == "deepseek_v4":
            raise ValueError("--train-mtp trains DeepSeek-V3's MTP layer; for a V4 preset use --mtp (untrained block)")
        init_checkpoint(out_dir, preset=preset, seed=seed, quant=quant, mtp=mtp or train_mtp)
        if train_mtp:
            from dsv4_engine.spec_decode.train import train_mtp as train

            report = train(out_dir, steps=train_steps, seed=seed)
            typer.echo(f"trained the MTP layer: {report}")
    except ValueError as e:
        _fail(str(e))
    typer.echo(f"wrote {preset} checkpoint (seed {seed}{', ' + quant if quant else ''}{', MTP layer' if mtp or train_mtp else ''}) "
               f"to {out_dir}")


def _secret(value: Optional[str], path: Optional[str], flag: str) -> Optional[str]:
    """A secret given as a value or in a file (a mounted Kubernetes Secret), never both."""
    if path is None:
        return value
    if value:
        _fail(f"give {flag} or {flag}-file, not both")
    try:
        secret = Path(path).read_text().strip()
    except OSError as e:
        _fail(f"{flag}-file {path}: {e.strerror or e}")
    if not secret:
        _fail(f"{flag}-file {path} is empty")
    return secret


def _loopback(host: str) -> bool:
    from dsv4_wire import is_loopback

    return host == "localhost" or is_loopback(host)


def _api_keys(keys: List[str], files: List[str]) -> list:
    from dsv4_wire.api_keys import load_api_keys

    try:
        return load_api_keys(keys, files)
    except ValueError as e:
        _fail(str(e))


@app.command()
def serve(
    model: Path = typer.Option(..., help="Checkpoint folder (from `dsv4 model init` or save_pretrained)."),
    role: str = typer.Option("mono", help="mono | prefill | decode"),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8100),
    advertise_host: Optional[str] = typer.Option(
        None, EngineFlags.ADVERTISE_HOST,
        help="PD: the address peers reach this engine at (decode tells prefill where to send aborts). Default: "
             "--host, unless it is 0.0.0.0 or ::, then $POD_IP, then 127.0.0.1."),
    bootstrap_port: Optional[int] = typer.Option(None, help="Prefill: port of the bootstrap endpoint (default port+1000)."),
    dtype: Optional[str] = typer.Option(None, help="float32 | bfloat16 (default: bfloat16 on CUDA, float32 on CPU)."),
    served_model_name: Optional[str] = typer.Option(None, help="Name in /v1/models (default: folder name)."),
    kv_pages: Optional[int] = typer.Option(None, help="KV pool size in pages (default: from --kv-memory-gb)."),
    kv_memory_gb: float = typer.Option(1.0, help="KV pool size in GiB when --kv-pages is not given."),
    page_size: Optional[int] = typer.Option(
        None, help="Tokens per KV page (default: 16, or the model's longest compression window when longer, "
                   "e.g. 128 for DeepSeek-V4-Flash, so compressed states fill their pages)."),
    max_num_seqs: int = typer.Option(64, help="Most requests running at once."),
    max_num_batched_tokens: int = typer.Option(1024, help="Token budget of one step (chunked prefill)."),
    max_model_len: Optional[int] = typer.Option(None, help="Context limit (default: the model's)."),
    kernel_backend: Optional[str] = typer.Option(None, help="torch | triton (default: triton on CUDA, else torch)."),
    device: Optional[str] = typer.Option(None, help="cpu | cuda (default: cuda when present)."),
    cuda_graph_max_bs: int = typer.Option(0, EngineFlags.CUDA_GRAPH_MAX_BS, min=0,
                                          help="Decode batches up to N requests replay captured CUDA graphs "
                                               "(CUDA + triton kernels; 0 = off)."),
    bootstrap_timeout: float = typer.Option(30.0, help="Seconds a PD request may wait for its peer."),
    transfer_timeout: float = typer.Option(30.0, help="Seconds a KV transfer may take."),
    waiting_timeout: float = typer.Option(60.0, help="Seconds decode waits for the KV of a request."),
    no_deadlines: bool = typer.Option(False, "--no-deadlines", help="Disable PD deadlines (reproduces the wedge; tests only)."),
    enable_fault_injection: bool = typer.Option(False, "--enable-fault-injection", help="Expose POST /admin/faults."),
    arm_fault: Optional[list[str]] = typer.Option(
        None, EngineFlags.ARM_FAULT,
        help="Arm a fault at start: NAME[:key=value,...], e.g. stall_long_context:tokens=300 (repeatable; needs "
             "--enable-fault-injection and a prefill or decode role; count defaults to -1, until cleared)."),
    admin_token: Optional[str] = typer.Option(None, envvar=ADMIN_TOKEN_ENV, help="Token required by /admin, /debug and "
                                              "/v1/loads (prefer --admin-token-file: argv is visible to every user)."),
    admin_token_file: Optional[str] = typer.Option(None, envvar=ADMIN_TOKEN_ENV + "_FILE", help="File holding the admin token."),
    pd_secret: Optional[str] = typer.Option(None, envvar=PD_SECRET_ENV, help="Shared secret of engine-to-engine PD calls and the router's internal requests "
                                            "(prefer --pd-secret-file). Required by prefill/decode engines on a non-loopback address."),
    pd_secret_file: Optional[str] = typer.Option(None, envvar=PD_SECRET_ENV + "_FILE", help="File holding the PD secret."),
    seed: int = typer.Option(0, help="Default sampling seed."),
    tp_size: int = typer.Option(1, EngineFlags.TP_SIZE, min=1,
                                help="Ranks (GPUs) one engine spans: attention heads and MLPs split, experts "
                                     "spread (NCCL on CUDA, gloo on CPU); this process is rank 0."),
    disable_prefix_cache: bool = typer.Option(
        False, EngineFlags.DISABLE_PREFIX_CACHE,
        help="Turn prefix caching off (on by default: a request reuses the KV pages of the longest cached prefix "
             "and, for DeepSeek-V4, a snapshot of its window/compressor state at a boundary; decode engines "
             "never reuse)."),
    prefix_cache_snapshots: Optional[int] = typer.Option(
        None, "--prefix-cache-snapshots", min=0,
        help="DeepSeek-V4: slot-row snapshots the prefix cache keeps, each one slot row of memory taken from "
             "--kv-memory-gb (default: 4 x --max-num-seqs; 0 turns V4 prefix reuse off)."),
    prefix_cache_snapshot_interval: Optional[int] = typer.Option(
        None, "--prefix-cache-snapshot-interval", min=0,
        help="DeepSeek-V4: tokens between the snapshots a prefill chunk leaves behind, besides its prompt's "
             "branch point and last boundary (default: 8 boundaries; 0: none; torch path only)."),
    max_request_bytes: int = typer.Option(16 * 1024 * 1024, "--max-request-bytes", min=1,
                                          help="Largest request body accepted (bigger: 413)."),
    shutdown_grace: float = typer.Option(30.0, EngineFlags.SHUTDOWN_GRACE, min=0.0,
                                         help="On SIGTERM: seconds running requests get to finish before they "
                                              "are ended with an error (Kubernetes' default termination grace)."),
    transfer_checksum: bool = typer.Option(False, EngineFlags.TRANSFER_CHECKSUM,
                                           help="PD: checksum every KV/state region of a hand-off; decode verifies "
                                                "what landed and fails the request on a mismatch."),
    chat_template: Optional[Path] = typer.Option(
        None, EngineFlags.CHAT_TEMPLATE, help="A Jinja chat template file used instead of the checkpoint's chat "
                                              "format (as vLLM's flag)."),
    tool_call_parser: Optional[str] = typer.Option(
        None, EngineFlags.TOOL_CALL_PARSER,
        help="How tool calls are read from the model's output: deepseek_v3, deepseek_v31, deepseek_v32, deepseek_v4 "
             "(SGLang's deepseekv31 etc. too; default: the checkpoint's format)."),
    reasoning_parser: Optional[str] = typer.Option(
        None, EngineFlags.REASONING_PARSER,
        help="How reasoning is split from the answer: deepseek-r1, deepseek-v3, deepseek-v4 (default: the "
             "checkpoint's format)."),
    otlp_traces_endpoint: Optional[str] = typer.Option(None, help="Export OpenTelemetry traces (OTLP/HTTP) to this URL, "
                                                       "e.g. http://collector:4318 (off by default)."),
    speculative_algorithm: Optional[str] = typer.Option(
        None, EngineFlags.SPECULATIVE_ALGORITHM,
        help="Speculative decoding with the checkpoint's own MTP layer: mtp (aliases EAGLE, NEXTN, deepseek_mtp). "
             "Off by default; DeepSeek-V3 checkpoints with an MTP layer, --role mono, --tp-size 1."),
    speculative_num_steps: int = typer.Option(1, EngineFlags.SPECULATIVE_NUM_STEPS, min=1,
                                              help="Tokens drafted per step with --speculative-algorithm."),
    api_key: List[str] = typer.Option([], "--api-key", help="Client API key required on /v1/* as `Authorization: Bearer` "
                                                            "(repeat for more; vLLM's flag). Prefer --api-key-file."),
    api_key_file: List[str] = typer.Option([], "--api-key-file", help="File of API keys, one a line (`KEY` or "
                                                                      "`NAME KEY`, NAME shown in metrics)."),
) -> None:
    """Run one engine (monolithic, prefill or decode) with the OpenAI-compatible HTTP API."""
    if role not in ("mono", "prefill", "decode"):
        _fail(f"--role must be mono, prefill or decode, not {role!r}")
    if dtype not in (None, "float32", "bfloat16"):
        _fail(f"--dtype must be float32 or bfloat16, not {dtype!r}")
    if kernel_backend not in (None, "torch", "triton"):
        _fail(f"--kernel-backend must be torch or triton, not {kernel_backend!r}")
    _check_model_dir(model, quantization=False)
    if arm_fault:
        if not enable_fault_injection:
            _fail(f"{EngineFlags.ARM_FAULT} needs {EngineFlags.ENABLE_FAULT_INJECTION}")
        if role == "mono":
            _fail(f"{EngineFlags.ARM_FAULT}: fault injection lives in the PD controllers; use --role prefill or decode")
        from dsv4_engine.pd.fault_names import parse_arm_fault

        try:
            for text in arm_fault:
                parse_arm_fault(text)
        except ValueError as e:
            _fail(str(e))
    if chat_template is not None and not chat_template.is_file():
        _fail(f"{EngineFlags.CHAT_TEMPLATE}: no file {chat_template}")
    from dsv4_serve.chat.registry import reasoning_parser_name, tool_parser as _tool_parser

    from dsv4_engine.spec_decode.options import normalize_algorithm

    try:
        speculative_algorithm = normalize_algorithm(speculative_algorithm)
        if tool_call_parser is not None:
            _tool_parser(tool_call_parser)
        if reasoning_parser is not None:
            reasoning_parser_name(reasoning_parser)
    except ValueError as e:
        _fail(str(e))
    keys = _api_keys(api_key, api_key_file)
    admin_token = _secret(admin_token, admin_token_file, "--admin-token")
    pd_secret = _secret(pd_secret, pd_secret_file, "--pd-secret")
    if role != "mono" and not pd_secret and not _loopback(host):
        _fail(f"--role {role} on {host} needs a PD secret (--pd-secret-file or {PD_SECRET_ENV}): without one anyone "
              f"who reaches the port can register as a peer and choose bootstrap targets")
    from dsv4_serve.core_spawn import spawn_core

    # The engine core starts importing torch now, beside this process (it waits for its arguments).
    # This process never imports torch: the checks that need it (quantization, the model's states
    # against --page-size / --tp-size) run in the core; a refusal is still one line and exit 2.
    spawned = spawn_core()
    from dsv4_serve.server import ServerArgs, run_server

    run_server(
        ServerArgs(
            model=str(model), role=role, host=host, port=port, advertise_host=advertise_host,
            bootstrap_port=bootstrap_port if bootstrap_port is not None else port + 1000,
            dtype=dtype, served_model_name=served_model_name or model.resolve().name,
            kv_pages=kv_pages, kv_memory_gb=kv_memory_gb, page_size=page_size,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, kernel_backend=kernel_backend, device=device,
            cuda_graph_max_bs=cuda_graph_max_bs, bootstrap_timeout=bootstrap_timeout, transfer_timeout=transfer_timeout,
            waiting_timeout=waiting_timeout, deadlines=not no_deadlines,
            enable_fault_injection=enable_fault_injection, arm_faults=list(arm_fault or []), admin_token=admin_token, pd_secret=pd_secret, seed=seed,
            max_request_bytes=max_request_bytes, shutdown_grace=shutdown_grace, transfer_checksum=transfer_checksum,
            enable_prefix_cache=not disable_prefix_cache, tp_size=tp_size,
            speculative_algorithm=speculative_algorithm, speculative_num_steps=speculative_num_steps,
            chat_template=str(chat_template) if chat_template is not None else None,
            tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
            otlp_traces_endpoint=otlp_traces_endpoint,
            prefix_cache_snapshots=prefix_cache_snapshots, prefix_cache_snapshot_interval=prefix_cache_snapshot_interval,
            api_keys=keys,
        ),
        spawned,
    )


@app.command()
def router(
    prefill: List[str] = typer.Option([], help="Prefill engine URL (repeat for more)."),
    decode: List[str] = typer.Option([], help="Decode engine URL (repeat for more)."),
    mono: List[str] = typer.Option([], help="Monolithic engine URL (repeat for more)."),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8000),
    discover_namespace: Optional[str] = typer.Option(None, help="Find engine pods in this Kubernetes namespace."),
    selector: Optional[str] = typer.Option(None, help="Label selector for discovery, e.g. app.kubernetes.io/instance=x."),
    health_interval: float = typer.Option(2.0, help="Seconds between /ready checks of each worker."),
    admin_token: Optional[str] = typer.Option(None, envvar=ADMIN_TOKEN_ENV, help="Token required by /admin (prefer "
                                              "--admin-token-file: argv is visible to every user)."),
    admin_token_file: Optional[str] = typer.Option(None, envvar=ADMIN_TOKEN_ENV + "_FILE", help="File holding the admin token."),
    pd_secret: Optional[str] = typer.Option(None, envvar=PD_SECRET_ENV, help="Shared secret sent with internal requests to PD engines."),
    pd_secret_file: Optional[str] = typer.Option(None, envvar=PD_SECRET_ENV + "_FILE", help="File holding the PD secret."),
    max_inflight: int = typer.Option(256, min=1, help="Most requests inside the router at once; more wait in the queue."),
    max_queue: int = typer.Option(256, min=0, help="Most requests waiting for a slot; more get 429 with Retry-After."),
    queue_timeout: float = typer.Option(30.0, min=0.001, help="Seconds a request may wait for a slot before 429."),
    max_body_bytes: int = typer.Option(16 * 1024 * 1024, min=1, help="Largest request body accepted (413 beyond)."),
    health_timeout: float = typer.Option(2.0, min=0.1, help="Seconds one /ready check of a worker may take."),
    request_timeout: float = typer.Option(600.0, min=1.0, help="Seconds an engine may stay silent on a request."),
    migration_limit: int = typer.Option(3, min=0, help="Times a request whose engine failed it mid-answer is sent again "
                                        "(with its answer so far) to another engine; 0: off."),
    migration_timeout: float = typer.Option(60.0, min=0.1, help="Seconds a request may spend, in all, being moved to "
                                            "another engine (waiting for one to be healthy included)."),
    otlp_traces_endpoint: Optional[str] = typer.Option(None, help="Export OpenTelemetry traces (OTLP/HTTP) to this URL, "
                                                       "e.g. http://collector:4318 (off by default)."),
    api_key: List[str] = typer.Option([], "--api-key", help="Client API key required on /v1/* (repeat for more)."),
    api_key_file: List[str] = typer.Option([], "--api-key-file", help="File of API keys, one a line (`KEY` or `NAME KEY`)."),
    key_max_concurrency: int = typer.Option(0, min=0, help="Requests one API key may have in flight (0: no limit; "
                                                            "more get 429 with Retry-After)."),
    key_rate_limit: float = typer.Option(0.0, min=0.0, help="Requests per second one API key may send (0: no limit)."),
    key_rate_burst: float = typer.Option(0.0, min=0.0, help="Requests one key may send at once above the rate "
                                                             "(default: max(1, rate))."),
    cache_salt_from_api_key: bool = typer.Option(False, "--cache-salt-from-api-key",
                                                 help="Give each API key its own prefix-cache namespace (cache_salt)."),
    engine_api_key: Optional[str] = typer.Option(None, envvar="DSV4_ENGINE_API_KEY",
                                                 help="Key the router shows mono engines started with --api-key "
                                                      "(PD engines take the PD secret)."),
) -> None:
    """Run the PD router: OpenAI API front, pairs prefill + decode per request.

    Without --admin-token, /admin/workers answers loopback clients only."""
    if not (prefill or decode or mono or discover_namespace):
        _fail("give --prefill and --decode URLs (or --mono URLs, or --discover-namespace)")
    if bool(prefill) != bool(decode):
        _fail("PD routing needs at least one --prefill and one --decode")
    keys = _api_keys(api_key, api_key_file)
    admin_token = _secret(admin_token, admin_token_file, "--admin-token")
    pd_secret = _secret(pd_secret, pd_secret_file, "--pd-secret")
    if cache_salt_from_api_key and not keys:
        _fail("--cache-salt-from-api-key needs --api-key or --api-key-file")
    from dsv4_router.router import RouterArgs, run_router
    from dsv4_router.tenancy import TenantLimits

    run_router(
        RouterArgs(
            prefill=list(prefill), decode=list(decode), mono=list(mono), host=host, port=port,
            discover_namespace=discover_namespace, selector=selector,
            health_interval=health_interval, admin_token=admin_token, pd_secret=pd_secret,
            max_inflight=max_inflight, max_queue=max_queue, queue_timeout=queue_timeout,
            max_body_bytes=max_body_bytes, health_timeout=health_timeout, request_timeout=request_timeout,
            migration_limit=migration_limit, migration_timeout=migration_timeout,
            otlp_traces_endpoint=otlp_traces_endpoint,
            api_keys=keys, key_limits=TenantLimits(key_max_concurrency, key_rate_limit, key_rate_burst),
            cache_salt_from_api_key=cache_salt_from_api_key, engine_api_key=engine_api_key,
        )
    )


def _reconfigure_up(port: int, engine_args: list[str], duration: float, concurrency: int, context_share: float,
                    growth_tokens: int, request_timeout: float) -> None:
    import json

    from dsv4_operator.local import cache_dir
    from dsv4_operator.reconfigure import ReconfigureRequest, submit

    request = ReconfigureRequest(engine_args, {"duration_s": duration, "concurrency": concurrency,
                                               "request_timeout_s": request_timeout,
                                               "shape": {"context_share": context_share, "growth_tokens": growth_tokens}})
    try:
        request.settings()
        result = submit(cache_dir() / "up" / str(port), request, timeout=duration + request_timeout + 600)
    except (RuntimeError, TimeoutError, ValueError) as e:
        _fail(str(e))
    print(json.dumps(result, indent=1))
    raise typer.Exit(0 if result.get("kept") else 1)


@app.command()
def up(
    model: Optional[Path] = typer.Option(None, help="Checkpoint folder (default: the tiny model, built into a cache)."),
    prefill: int = typer.Option(1, help="Prefill engines."),
    decode: int = typer.Option(1, help="Decode engines."),
    port: int = typer.Option(8000, help="Router port (the one to curl)."),
    host: str = typer.Option("127.0.0.1", help="Router address (engines always bind 127.0.0.1)."),
    mono: bool = typer.Option(False, "--mono", help="One monolithic engine behind the router instead of PD."),
    enable_fault_injection: bool = typer.Option(False, "--enable-fault-injection"),
    no_deadlines: bool = typer.Option(False, "--no-deadlines", help="Disable engine PD deadlines (reproduce the wedge)."),
    watchdog: bool = typer.Option(True, "--watchdog/--no-watchdog", help="Run the wedge watchdog on the engines."),
    detection_window: Optional[float] = typer.Option(
        None, help="Seconds without progress before an engine is wedged. It must outlast the engines' own PD "
        "deadlines (bootstrap 30, transfer 30, waiting 60 s, or what --engine-arg sets) by two scrape intervals, "
        "so that a stalled transfer the engine fails by itself never becomes a restart; shorter is refused "
        "unless --no-deadlines. Default: the longest deadline + 15 s (75 s), or 20 s with --no-deadlines."),
    scrape_interval: float = typer.Option(2.0, help="Seconds between the watchdog's scrapes of every engine."),
    evidence_dir: Optional[Path] = typer.Option(None, help="Where evidence of wedges is written."),
    engine_arg: List[str] = typer.Option([], help="Extra argument passed to every engine (repeat)."),
    tp_size: int = typer.Option(1, EngineFlags.TP_SIZE, min=1, help="Ranks each engine spans (dsv4 serve --tp-size)."),
    admin_token: Optional[str] = typer.Option(
        None, envvar=ADMIN_TOKEN_ENV, help="Admin token of the engines and router (default: generated and kept, "
        "mode 0600, in the state folder ~/.cache/dsv4/up/PORT). Prefer the environment variable: "
        "a command line is visible to every user in `ps`."),
    pd_secret: Optional[str] = typer.Option(
        None, envvar=PD_SECRET_ENV, help="Secret of engine-to-engine PD calls (default: generated and kept, "
        "mode 0600, in the state folder)."),
    reconfigure: bool = typer.Option(
        False, "--reconfigure", help="Change the engine flags of the `dsv4 up` running on --port to the --engine-arg "
        "values given here (they replace the old extra args): one engine restarts with them behind a canary probe "
        "(a growing agent conversation) and the change is kept and rolled to the rest, or reverted. Exit 0: kept; "
        "1: reverted."),
    probe_duration: float = typer.Option(60.0, help="--reconfigure: seconds the canary probe sends requests."),
    probe_concurrency: int = typer.Option(2, min=1, help="--reconfigure: conversations the probe runs at once."),
    probe_context_share: float = typer.Option(0.5, help="--reconfigure: the share of the model's context the "
                                              "probe's conversation grows to."),
    probe_growth_tokens: int = typer.Option(96, min=1, help="--reconfigure: tokens each round adds (a tool call's size)."),
    probe_request_timeout: float = typer.Option(20.0, help="--reconfigure: seconds after which an unanswered probe "
                                                "request counts as stalled."),
) -> None:
    """Run router + prefill + decode engines as local processes, watched by the wedge policy.

    A process that dies is restarted at once (then after 1, 2, 4 ... up to 30 s while it keeps
    crashing; the count starts again once it ran 60 s). The watchdog remediates engines that are
    alive but wedged. Secrets reach the processes through their environment, never their command
    line; admin calls need `Authorization: Bearer <token from the admin-token file>`.
    """
    if reconfigure:
        _reconfigure_up(port, list(engine_arg), probe_duration, probe_concurrency, probe_context_share,
                        probe_growth_tokens, probe_request_timeout)
        return
    if model is not None:
        _check_model_dir(model)
        if not mono or tp_size > 1:  # a role the model cannot take is refused here, not in a restart loop
            from dsv4_engine.engine import serving_refusal

            refusal = serving_refusal(str(model), "mono" if mono else "prefill", None, tp_size)
            if refusal:
                _fail(f"{model}: {refusal}")
    if tp_size > 1:
        engine_arg = [*engine_arg, EngineFlags.TP_SIZE, str(tp_size)]
    if prefill < 1 or decode < 1:
        _fail("--prefill and --decode must be at least 1")
    if scrape_interval <= 0:
        _fail("--scrape-interval must be positive")
    from dsv4_operator.local import UpArgs, detection_window as window_for, engine_deadlines, run_up

    try:  # refuse a window shorter than the engines' deadlines before building anything
        window_for(detection_window, None if no_deadlines else engine_deadlines(engine_arg), scrape_interval)
    except ValueError as e:
        _fail(str(e))
    run_up(
        UpArgs(
            model=model if model is not None else _default_model(), dsv4_command=_dsv4_command(), prefill=prefill,
            decode=decode, port=port, host=host, mono=mono, enable_fault_injection=enable_fault_injection,
            deadlines=not no_deadlines, watchdog=watchdog, detection_window=detection_window,
            scrape_interval=scrape_interval, evidence_dir=evidence_dir, engine_args=list(engine_arg),
            admin_token=admin_token, pd_secret=pd_secret,
        )
    )


@app.command("operator")
def operator_cmd(
    namespace: List[str] = typer.Option([], help="Namespace to watch (repeat); default all namespaces."),
    standalone: bool = typer.Option(
        False, "--standalone",
        help="Disable leader election (the Lease dsv4-operator): for a single replica only, two would both act."),
    health_port: int = typer.Option(8080, help="Port of /healthz and /metrics."),
    log_format: str = typer.Option("json", help="json | plain"),
) -> None:
    """Run the kopf operator for DSV4Deployment (KUBECONFIG or in-cluster config)."""
    from dsv4_operator.main import run_operator

    run_operator(namespaces=list(namespace), standalone=standalone, health_port=health_port, log_format=log_format)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
