"""The `dsv4` command line: one typer app; each command imports its implementation lazily so
that `dsv4 --help` stays fast and a command only pays for what it uses."""

from __future__ import annotations

import functools
import json
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
from dsv4_cli.options import choice_error, command, field_values  # noqa: E402
from dsv4_wire import ADMIN_TOKEN_ENV, PD_SECRET_ENV, EngineFlags  # noqa: E402
from dsv4_wire.router_options import ROUTER_SCOPES, router_options  # noqa: E402
from dsv4_wire.serve_options import SERVE_SCOPES, options as serve_options  # noqa: E402

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
    from dsv4_operator.local.up import cache_dir

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
        "tiny",
        help="Model preset: tiny | mla512 | moe32 (DeepSeek-V3; moe32: 32 routed experts, for EPLB) | v4-tiny | v4-tiny-long (16,384 positions) | v4-moe32 (32 routed experts, for EPLB) | v4-flash-shape (DeepSeek-V4, release layout).",
    ),
    seed: int = typer.Option(0, help="Seed; the same seed writes the same checkpoint."),
    quant: Optional[str] = typer.Option(
        None,
        help="Quantize the linear weights: fp8 (block-scaled e4m3, any preset) | fp4-experts (V4 presets: "
        "fp4 routed experts, fp8 elsewhere, as DeepSeek-V4 ships).",
    ),
    mtp: bool = typer.Option(
        False,
        "--mtp",
        help="Add one multi-token-prediction layer (V3: model.layers.N, V4: mtp.0; "
        "num_nextn_predict_layers: 1) for --speculative-algorithm mtp.",
    ),
    train: bool = typer.Option(
        False,
        "--train",
        help="Train the main model (any float preset; v4-flash-shape is far too big for CPU minutes) on the shipped corpus for a few CPU minutes, so "
        "that its greedy continuations have structure (a random model's are close to a hash of the context).",
    ),
    train_base_steps: int = typer.Option(150, "--train-base-steps", min=1, help="Optimizer steps of --train."),
    train_mtp: bool = typer.Option(
        False,
        "--train-mtp",
        help="Implies --mtp: self-distil the MTP layer (V3 or V4) on the model's own greedy "
        "continuations of corpus prompts (a few CPU minutes; after --train when both are given) so that "
        "speculation accepts drafts.",
    ),
    train_steps: int = typer.Option(200, "--train-steps", min=1, help="Optimizer steps of --train-mtp."),
    num_layers: Optional[int] = typer.Option(
        None,
        "--num-layers",
        help="Override the preset's num_hidden_layers (at least 1), e.g. a 16-layer tiny model where one "
        "MTP layer costs a realistic share of a forward. V4 presets keep their first layers' types and "
        "go on alternating their last two (CSA / HCA), hash-routed layers first.",
    ),
) -> None:
    """Write a Hugging Face-format DeepSeek-V3 or -V4 checkpoint (config, safetensors, tokenizer)."""
    from dsv4_engine.checkpoint import PRESETS, init_checkpoint

    if preset not in PRESETS:
        _fail(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    try:
        for flag, on in (("--train", train), ("--train-mtp", train_mtp)):
            if on and quant:
                raise ValueError(f"{flag} trains float weights: write the checkpoint without --quant")
        init_checkpoint(out_dir, preset=preset, seed=seed, quant=quant, mtp=mtp or train_mtp, num_layers=num_layers)
        if train:
            from dsv4_engine.spec_decode.train import train_base

            typer.echo(f"trained the main model: {train_base(out_dir, steps=train_base_steps, seed=seed)}")
        if train_mtp:
            from dsv4_engine.spec_decode.train import train_mtp as distil

            typer.echo(f"trained the MTP layer: {distil(out_dir, steps=train_steps, seed=seed)}")
    except ValueError as e:
        _fail(str(e))
    typer.echo(
        f"wrote {preset} checkpoint (seed {seed}{f', {num_layers} layers' if num_layers else ''}"
        f"{', ' + quant if quant else ''}{', trained' if train else ''}"
        f"{', MTP layer' if mtp or train_mtp else ''}) "
        f"to {out_dir}"
    )


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


def _read_command_inputs(declared: list, values: dict, given: dict) -> None:
    """Fill the fields the command's own inputs stand for: the API keys from --api-key and
    --api-key-file, and each secret from its value or its file twin (dsv4_wire.options.secret)."""
    values["api_keys"] = _api_keys(given["api_key"], given["api_key_file"])
    by_name = {o.name: o for o in declared}
    for o in declared:
        field = o.name.removesuffix("_file")
        if o.scope == "command" and field != o.name and field in values and field in by_name:
            values[field] = _secret(values[field], given[o.name], by_name[field].cli_flag)


def _api_keys(keys: List[str], files: List[str]) -> list:
    from dsv4_wire.api_keys import load_api_keys

    try:
        return load_api_keys(keys, files)
    except ValueError as e:
        _fail(str(e))


def _serve(**given) -> None:
    """Run one engine (monolithic, prefill or decode) with the OpenAI-compatible HTTP API."""
    declared = serve_options(*SERVE_SCOPES)
    refusal = choice_error(declared, given)
    if refusal:
        _fail(refusal)
    values = field_values(declared, given)
    role, model = values["role"], Path(values["model"])
    _check_model_dir(model, quantization=False)
    if values["arm_faults"]:
        if not values["enable_fault_injection"]:
            _fail(f"{EngineFlags.ARM_FAULT} needs {EngineFlags.ENABLE_FAULT_INJECTION}")
        if role == "mono":
            _fail(f"{EngineFlags.ARM_FAULT}: fault injection lives in the PD controllers; use --role prefill or decode")
        from dsv4_engine.pd.fault_names import parse_arm_fault

        try:
            for text in values["arm_faults"]:
                parse_arm_fault(text)
        except ValueError as e:
            _fail(str(e))
    if values["chat_template"] is not None and not Path(values["chat_template"]).is_file():
        _fail(f"{EngineFlags.CHAT_TEMPLATE}: no file {values['chat_template']}")
    from dsv4_serve.chat.effort import profile_declared
    from dsv4_serve.chat.registry import reasoning_parser_name, tool_parser as _tool_parser

    from dsv4_engine.spec_decode.options import normalize_algorithm

    try:
        values["speculative_algorithm"] = normalize_algorithm(values["speculative_algorithm"])
        if values["tool_call_parser"] is not None:
            _tool_parser(values["tool_call_parser"])
        if values["reasoning_parser"] is not None:
            reasoning_parser_name(values["reasoning_parser"])
        config = json.loads((model / "config.json").read_text(encoding="utf-8"))
        if isinstance(config, dict) and config.get("model_type") == "deepseek_v4":
            profile_declared(str(model), config)  # a declared effort profile we do not know
    except ValueError as e:
        _fail(str(e))
    _read_command_inputs(declared, values, given)
    if role != "mono" and not values["pd_secret"] and not _loopback(values["host"]):
        _fail(
            f"--role {role} on {values['host']} needs a PD secret (--pd-secret-file or {PD_SECRET_ENV}): without "
            f"one anyone who reaches the port can register as a peer and choose bootstrap targets"
        )
    values["served_model_name"] = values["served_model_name"] or model.resolve().name
    from dsv4_engine.parallel.layout import layout_refusal

    refusal = layout_refusal(values["tp_size"], values["nnodes"], values["node_rank"], values["dist_init_addr"])
    if refusal:
        _fail(refusal)
    if values["nnodes"] > 1 and values["pd_secret"]:
        # The node channel of a multi-node engine authenticates its nodes with the PD secret; the
        # processes it starts read it from the environment (never argv).
        import os

        os.environ.setdefault(PD_SECRET_ENV, values["pd_secret"])
    if values["node_rank"] > 0:  # a worker node: its ranks and a small HTTP surface, no engine of its own
        from dsv4_serve.node_server import run_node_server

        raise typer.Exit(run_node_server(values))
    from dsv4_serve.core_spawn import spawn_core

    # The engine core starts importing torch now, beside this process (it waits for its arguments).
    # This process never imports torch: the checks that need it (quantization, the model's states
    # against --page-size / --tp-size) run in the core; a refusal is still one line and exit 2.
    spawned = spawn_core()
    from dsv4_serve.process import run_server
    from dsv4_serve.server_args import ServerArgs

    run_server(ServerArgs(**values), spawned)


app.command("serve")(command(serve_options(*SERVE_SCOPES), _serve))


def _serve_params(argv: list[str]) -> dict:
    """`dsv4 serve` arguments parsed as that command parses them (nothing run): for checks made
    before `dsv4 up` starts its engines."""
    return _serve_command().make_context("serve", argv, resilient_parsing=True).params


@functools.lru_cache(maxsize=1)
def _serve_command():
    return typer.main.get_command(app).commands["serve"]


def _router(**given) -> None:
    """Run the PD router: OpenAI API front, pairs prefill + decode per request."""
    values = field_values(router_options(*ROUTER_SCOPES), given)
    if not (values["prefill"] or values["decode"] or values["mono"] or values["discover_namespace"]):
        _fail("give --prefill and --decode URLs (or --mono URLs, or --discover-namespace)")
    if bool(values["prefill"]) != bool(values["decode"]):
        _fail("PD routing needs at least one --prefill and one --decode")
    _read_command_inputs(router_options(*ROUTER_SCOPES), values, given)
    if values["cache_salt_from_api_key"] and not values["api_keys"]:
        _fail("--cache-salt-from-api-key needs --api-key or --api-key-file")
    if values["cache_salt_from_api_key"] and values["shared_prefix_cache"]:
        _fail("--cache-salt-from-api-key and --shared-prefix-cache contradict each other")
    from dsv4_router.app import run_router
    from dsv4_router.router_args import RouterArgs

    tokenize = None
    if values.get("tokenizer"):  # the engine's renderer and tokenizer: this package may import them
        from dsv4_serve.chat_prompt import PromptIds

        tokenize = PromptIds(values["tokenizer"], values.get("chat_template"))
    run_router(RouterArgs(**values), tokenize)


app.command("router")(command(router_options(*ROUTER_SCOPES), _router))


def _reconfigure_up(
    port: int,
    engine_args: list[str],
    duration: float,
    concurrency: int,
    context_share: float,
    growth_tokens: int,
    request_timeout: float,
) -> None:
    import json

    from dsv4_operator.local.up import cache_dir
    from dsv4_operator.local.reconfigure import ReconfigureRequest, submit

    request = ReconfigureRequest(
        engine_args,
        {
            "duration_s": duration,
            "concurrency": concurrency,
            "request_timeout_s": request_timeout,
            "shape": {"context_share": context_share, "growth_tokens": growth_tokens},
        },
    )
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
    no_deadlines: bool = typer.Option(
        False, "--no-deadlines", help="Disable engine PD deadlines (reproduce the wedge)."
    ),
    watchdog: bool = typer.Option(True, "--watchdog/--no-watchdog", help="Run the wedge watchdog on the engines."),
    detection_window: Optional[float] = typer.Option(
        None,
        help="Seconds without progress before an engine is wedged. It must outlast the engines' own PD "
        "deadlines (bootstrap 30, transfer 30, waiting 60 s, or what --engine-arg sets) by two scrape intervals, "
        "so that a stalled transfer the engine fails by itself never becomes a restart; shorter is refused "
        "unless --no-deadlines. Default: the longest deadline + 15 s (75 s), or 20 s with --no-deadlines.",
    ),
    scrape_interval: float = typer.Option(2.0, help="Seconds between the watchdog's scrapes of every engine."),
    evidence_dir: Optional[Path] = typer.Option(None, help="Where evidence of wedges is written."),
    engine_arg: List[str] = typer.Option([], help="Extra argument passed to every engine (repeat)."),
    tp_size: int = typer.Option(1, EngineFlags.TP_SIZE, min=1, help="Ranks each engine spans (dsv4 serve --tp-size)."),
    dp_size: int = typer.Option(
        1,
        EngineFlags.DP_SIZE,
        min=1,
        help="Data-parallel attention in every engine (dsv4 serve --tp-size N --dp-size N; implies --tp-size N): "
        "each rank attends over its own requests and holds only their KV. One layout for every role, as "
        "--tp-size (docs/tensor-parallel.md).",
    ),
    nnodes: int = typer.Option(
        1,
        EngineFlags.NNODES,
        min=1,
        help="Run each engine as a group of this many local 'node' processes (dsv4 serve --nnodes, on "
        "127.0.0.1): node 0 serves, the others run ranks only, and the group restarts as one. --tp-size is "
        "the whole engine's (default with --nnodes: one rank per node).",
    ),
    admin_token: Optional[str] = typer.Option(
        None,
        envvar=ADMIN_TOKEN_ENV,
        help="Admin token of the engines and router (default: generated and kept, "
        "mode 0600, in the state folder ~/.cache/dsv4/up/PORT). Prefer the environment variable: "
        "a command line is visible to every user in `ps`.",
    ),
    pd_secret: Optional[str] = typer.Option(
        None,
        envvar=PD_SECRET_ENV,
        help="Secret of engine-to-engine PD calls (default: generated and kept, mode 0600, in the state folder).",
    ),
    surge: Optional[bool] = typer.Option(
        None,
        "--surge/--no-surge",
        help="Planned restarts (--reconfigure, its canary and revert) start the new engine on new ports and route "
        "to it before the old one drains and stops, so a role with one engine never has none. Default: on unless "
        "a GPU is present (a second engine would take memory the running one sized its KV pool against); off, or "
        "where it cannot (an engine of several --nnodes processes), the engine restarts in place and the router "
        "holds new requests until it is back.",
    ),
    reconfigure: bool = typer.Option(
        False,
        "--reconfigure",
        help="Change the engine flags of the `dsv4 up` running on --port to the --engine-arg "
        "values given here (they replace the old extra args): one engine restarts with them behind a canary probe "
        "(a growing agent conversation) and the change is kept and rolled to the rest, or reverted. Exit 0: kept; "
        "1: reverted.",
    ),
    probe_duration: float = typer.Option(60.0, help="--reconfigure: seconds the canary probe sends requests."),
    probe_concurrency: int = typer.Option(2, min=1, help="--reconfigure: conversations the probe runs at once."),
    probe_context_share: float = typer.Option(
        0.5, help="--reconfigure: the share of the model's context the probe's conversation grows to."
    ),
    probe_growth_tokens: int = typer.Option(
        96, min=1, help="--reconfigure: tokens each round adds (a tool call's size)."
    ),
    probe_request_timeout: float = typer.Option(
        20.0, help="--reconfigure: seconds after which an unanswered probe request counts as stalled."
    ),
) -> None:
    """Run router + prefill + decode engines as local processes, watched by the wedge policy.

    A process that dies is restarted at once (then after 1, 2, 4 ... up to 30 s while it keeps
    crashing; the count starts again once it ran 60 s). The watchdog remediates engines that are
    alive but wedged. Secrets reach the processes through their environment, never their command
    line; admin calls need `Authorization: Bearer <token from the admin-token file>`.
    """
    if reconfigure:
        _reconfigure_up(
            port,
            list(engine_arg),
            probe_duration,
            probe_concurrency,
            probe_context_share,
            probe_growth_tokens,
            probe_request_timeout,
        )
        return
    from dsv4_cli.up_parallel import dp_up_refusal, engine_roles, parallel_flags, parallel_sizes, serve_argv

    try:
        tp_size, dp_size = parallel_sizes(tp_size, dp_size)
    except ValueError as e:
        _fail(str(e))
    if nnodes > 1 and tp_size == 1:
        tp_size = nnodes  # one rank per node
    if tp_size % nnodes:
        _fail(f"--tp-size {tp_size} does not split over --nnodes {nnodes}: every node runs the same number of ranks")
    if model is not None:
        _check_model_dir(model)
        if not mono or tp_size > 1:  # a role the model cannot take is refused here, not in a restart loop
            from dsv4_engine.engine import serving_refusal

            refusal = serving_refusal(str(model), "mono" if mono else "prefill", None, tp_size)
            if refusal:
                _fail(f"{model}: {refusal}")
    if dp_size > 1:  # what the engines would refuse at start is refused here, once, not in a restart loop
        argv = serve_argv(model if model is not None else _default_model(), engine_arg, tp_size, dp_size)
        argv += [EngineFlags.NNODES, str(nnodes)] if nnodes > 1 else []
        refusal = dp_up_refusal(engine_roles(mono), _serve_params(argv))
        if refusal:
            _fail(refusal)
    engine_arg = [*engine_arg, *parallel_flags(tp_size, dp_size)]
    if prefill < 1 or decode < 1:
        _fail("--prefill and --decode must be at least 1")
    if scrape_interval <= 0:
        _fail("--scrape-interval must be positive")
    from dsv4_operator.local.up import UpArgs, detection_window as window_for, engine_deadlines, run_up
    from dsv4_operator.local.surge import gpu_present, surge_by_default

    try:  # refuse a window shorter than the engines' deadlines before building anything
        window_for(detection_window, None if no_deadlines else engine_deadlines(engine_arg), scrape_interval)
    except ValueError as e:
        _fail(str(e))
    run_up(
        UpArgs(
            model=model if model is not None else _default_model(),
            dsv4_command=_dsv4_command(),
            prefill=prefill,
            decode=decode,
            port=port,
            host=host,
            mono=mono,
            enable_fault_injection=enable_fault_injection,
            deadlines=not no_deadlines,
            watchdog=watchdog,
            detection_window=detection_window,
            scrape_interval=scrape_interval,
            evidence_dir=evidence_dir,
            engine_args=list(engine_arg),
            nnodes=nnodes,
            surge=surge if surge is not None else surge_by_default(gpu_present()),
            admin_token=admin_token,
            pd_secret=pd_secret,
        )
    )


@app.command("operator")
def operator_cmd(
    namespace: List[str] = typer.Option([], help="Namespace to watch (repeat); default all namespaces."),
    standalone: bool = typer.Option(
        False,
        "--standalone",
        help="Disable leader election (the Lease dsv4-operator): for a single replica only, two would both act.",
    ),
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
