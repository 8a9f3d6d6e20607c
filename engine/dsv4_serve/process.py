"""`dsv4 serve`'s HTTP process: starts the engine core (`engine_client.EngineClient.start`), serves
the app (`app.build_app`, plus the PD routes on a PD role) with uvicorn, and exits when the core
dies.

Shutdown: SIGTERM (or SIGINT) drains — new generation requests get a 503, /ready says
"draining", running requests get `--shutdown-grace` seconds to finish, the rest are then ended
with an error — and the process exits 0. A second signal cuts the grace short.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time

import uvicorn
from dsv4_wire.slow_clients import bounded

from dsv4_engine.tokenizer import Tokenizer
from dsv4_serve.engine_client import (
    CORE_ANSWER_TIMEOUT,
    EngineClient,
    EngineGone,
    EngineRefused,
    EngineStartError,
    call_soon,
)
from dsv4_serve.gate import Lifecycle
from dsv4_serve.server_args import ServerArgs
from dsv4_serve.app import build_app
from dsv4_serve.uvicorn_server import UvicornServer

log = logging.getLogger("dsv4.server")
# After the engine core died: /health says so and in-flight requests get their error for this
# long, then the HTTP process exits 1 so that its supervisor (kubelet, `dsv4 up`) restarts both.
DEAD_CORE_EXIT_DELAY = 5.0


async def drain(client: EngineClient, lifecycle: Lifecycle, grace: float, hurry: asyncio.Event) -> None:
    """Stop taking requests, let running ones finish for up to `grace` seconds (or until `hurry`
    is set by a second signal), then end the rest with an error and wait for their answers."""
    lifecycle.draining = True
    start = time.monotonic()

    async def core_busy() -> bool:
        try:
            return (await client.ask("state", timeout=CORE_ANSWER_TIMEOUT))["seqs"] > 0
        except (EngineGone, asyncio.TimeoutError):
            return False  # a core that is gone or mute has nothing left to finish

    async def busy() -> bool:
        return lifecycle.active > 0 or await core_busy()

    try:
        await client.ask("drain", timeout=CORE_ANSWER_TIMEOUT)
    except (EngineGone, asyncio.TimeoutError):
        pass
    log.warning("draining: %d request(s) running, up to %.1fs to finish", lifecycle.active, grace)
    while await busy() and time.monotonic() - start < grace and not hurry.is_set():
        await asyncio.sleep(0.05)
    if await busy():
        log.warning("drain grace over: ending %d running request(s) with an error", lifecycle.active)
        lifecycle.closed = True
        try:
            client.abort(reason="server shutting down", all_=True)
        except EngineGone:
            pass
        end = time.monotonic() + 5.0
        while lifecycle.active > 0 and time.monotonic() < end:
            await asyncio.sleep(0.02)
    log.warning("drained in %.1fs", time.monotonic() - start)


def run_server(args: ServerArgs, spawned=None) -> None:
    """Serve until SIGTERM/SIGINT; `spawned`: a `core_spawn.spawn_core()` started earlier."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        client = EngineClient.start(args, spawned)  # the engine core process: model, KV pool, PD, bootstrap
    except EngineRefused as e:  # as the CLI refuses any bad flag: one line, exit 2
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except EngineStartError as e:
        print(f"dsv4 serve: the engine could not start: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    try:
        _serve_http(client, args)
    finally:
        died = client.dead is not None
        client.shutdown()
    if died:
        sys.exit(1)


def _serve_http(client: EngineClient, args: ServerArgs) -> None:
    lifecycle = Lifecycle()
    app = build_app(client, Tokenizer.from_dir(args.model), args, lifecycle)
    if args.role != "mono":
        from dsv4_serve.pd_routes import extend_app

        extend_app(app, client, args)
    app, limits = bounded(app, args.client_timeout, args.max_connections)  # slow and many clients
    servers = [
        UvicornServer(
            uvicorn.Config(
                app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5, **limits
            )
        )
    ]
    extra = f", bootstrap on port {args.bootstrap_port}" if args.role == "prefill" else ""
    print(
        f"dsv4 serve: {args.role} engine for {args.served_model_name} on http://{args.host}:{args.port}{extra} "
        f"({client.info['num_pages']} KV pages of {client.info['page_size']} tokens, max_model_len {client.max_model_len}, "
        f"kernels {client.info.get('kernel_summary') or client.info['kernel_backend']}; engine core pid {client.pid})",
        flush=True,
    )

    async def serve_all() -> None:
        loop = asyncio.get_running_loop()
        signalled, hurry = asyncio.Event(), asyncio.Event()

        def on_signal() -> None:
            (hurry if signalled.is_set() else signalled).set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        gone = asyncio.Event()
        client.on_gone = lambda: call_soon(loop, gone.set)
        if not client.alive:
            gone.set()
        tasks = [asyncio.create_task(s.serve()) for s in servers]
        waiter = asyncio.create_task(signalled.wait())
        core_waiter = asyncio.create_task(gone.wait())
        done, _ = await asyncio.wait([waiter, core_waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
        if waiter in done:  # SIGTERM/SIGINT: drain, then let uvicorn close the connections
            await drain(client, lifecycle, args.shutdown_grace, hurry)
        elif core_waiter in done:
            log.error("the engine core process is gone (%s): exiting in %.0fs", client.dead, DEAD_CORE_EXIT_DELAY)
            await asyncio.sleep(DEAD_CORE_EXIT_DELAY)
        waiter.cancel()
        core_waiter.cancel()
        for s in servers:
            s.should_exit = True
        await asyncio.gather(*tasks)

    asyncio.run(serve_all())
