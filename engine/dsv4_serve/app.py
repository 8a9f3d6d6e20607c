"""The engine's HTTP app: the OpenAI routes (served by `serving.OpenAIServing`), health and
readiness, metrics, live loads, admin and debug. Two processes stand behind it: this one (HTTP,
validation, tokenising, chat templates) and the engine core (`engine_core`: scheduler, model,
KV pool, PD controllers and the prefill's bootstrap server). /metrics and /v1/loads are the
core's own, fetched over the channel; /debug/stacks shows both processes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import traceback
import uuid
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsv4_engine.tokenizer import Tokenizer
from dsv4_serve.admin import error_response, require_admin, thread_stacks
from dsv4_serve.agent_routes import add_agent_routes
from dsv4_serve.engine_client import CORE_ANSWER_TIMEOUT, EngineClient, EngineGone
from dsv4_serve.gate import Gate, Lifecycle
from dsv4_serve.kv_events_route import add_kv_events_route
from dsv4_serve.eplb_routes import add_eplb_routes
from dsv4_serve.sessions import add_session_routes
from dsv4_serve.server_args import ServerArgs
from dsv4_serve.serving import OpenAIServing, internal_error
from dsv4_serve.awaiting import http_waiting_metric
from dsv4_wire import APIError, Paths
from dsv4_wire.api_keys import ApiKeyGate, KeyRing

log = logging.getLogger("dsv4.server")


def build_app(
    client: EngineClient, tokenizer: Tokenizer, args: ServerArgs, lifecycle: Optional[Lifecycle] = None
) -> FastAPI:
    app = FastAPI(title="dsv4 engine", docs_url=None, redoc_url=None, openapi_url=None)
    lifecycle = lifecycle or Lifecycle()
    serving = OpenAIServing(client, tokenizer, args, lifecycle)
    app.state.client = client
    app.state.serving = serving
    app.add_middleware(
        Gate,
        lifecycle=lifecycle,
        max_request_bytes=args.max_request_bytes,
        admin_token=args.admin_token,
        pd_secret=args.pd_secret,
    )
    # Outermost: a request without a key is refused before its body is read. The router's
    # internal requests pass with the PD secret.
    app.add_middleware(ApiKeyGate, ring=KeyRing(args.api_keys, internal=args.pd_secret))

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = f"{loc}: {first.get('msg', 'invalid request')}" if loc else first.get("msg", "invalid request")
        return error_response(APIError(msg, 400, param=loc or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(http: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            msg = f"Invalid URL ({http.method} {http.url.path})"
        elif e.status_code == 405:
            msg = f"Method {http.method} is not allowed on {http.url.path}"
        else:
            msg = str(e.detail)
        return error_response(
            APIError(msg, e.status_code, "invalid_request_error" if e.status_code < 500 else "server_error")
        )

    @app.exception_handler(Exception)
    async def _unexpected(http: Request, e: Exception):
        ref = uuid.uuid4().hex[:12]
        log.error("%s %s failed (reference %s):\n%s", http.method, http.url.path, ref, traceback.format_exc())
        return error_response(internal_error(ref))

    @app.post(Paths.COMPLETIONS)
    async def completions(http: Request):
        return await serving.serve(serving.prepare_completion, http)

    @app.post(Paths.CHAT_COMPLETIONS)
    async def chat(http: Request):
        return await serving.serve(serving.prepare_chat, http)

    add_agent_routes(app, serving)

    @app.get(Paths.MODELS)
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": serving.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "dsv4",
                    "max_model_len": client.max_model_len,
                }
            ],
        }

    async def core_state() -> tuple[Optional[dict], str]:
        """The core's loop state, or None and why there is none (process gone, not answering)."""
        if not client.alive:
            return None, client.dead or "engine process exited"
        try:
            return await client.ask("state", timeout=CORE_ANSWER_TIMEOUT), ""
        except EngineGone as e:
            return None, str(e)
        except asyncio.TimeoutError:
            return None, f"engine process not answering for {CORE_ANSWER_TIMEOUT:.0f}s"

    @app.get(Paths.HEALTH)
    async def health():
        state, why = await core_state()
        if state is None:
            return JSONResponse({"status": why}, status_code=503)
        if not state["alive"]:
            return JSONResponse({"status": state.get("failed") or "engine loop stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get(Paths.READY)
    async def ready():
        state, why = await core_state()
        if state is None:
            return JSONResponse({"ready": False, "reason": why}, status_code=503)
        if not state["alive"] or state["stalled"] > state["stall_allowance"]:
            return JSONResponse(
                {
                    "ready": False,
                    "reason": f"engine loop not progressing ({state['stalled']:.1f}s, "
                    f"more than the {state['stall_allowance']:.0f}s its current step may take)",
                },
                status_code=503,
            )
        if state["draining"] or lifecycle.draining:
            return JSONResponse({"ready": False, "reason": "draining"}, status_code=503)
        return {"ready": True}

    async def from_core(name: str):
        try:
            return await client.ask(name, timeout=CORE_ANSWER_TIMEOUT)
        except (EngineGone, asyncio.TimeoutError) as e:
            raise APIError(f"engine process unavailable: {str(e) or 'no answer'}", 503, "server_error") from None

    @app.get(Paths.METRICS)
    async def metrics():
        # The core's registry, rendered there: one scrape, one round trip, the same text as ever;
        # and the one gauge only this process knows (awaiting.py)
        extra = http_waiting_metric(serving.awaiting.count, args.role, serving.model_name).encode()
        text = await from_core("metrics") + extra
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get(Paths.SERVER_INFO)
    async def server_info():
        return {
            "role": args.role,
            "model": serving.model_name,
            "bootstrap_port": args.bootstrap_port if args.role == "prefill" else None,
            "boot_id": client.info["boot_id"],
            "max_model_len": client.max_model_len,
            "page_size": client.info["page_size"],
            "kernel_backend": client.info["kernel_backend"],
            "pid": os.getpid(),
            "engine_pid": client.pid,
        }

    @app.get(Paths.LOADS)
    async def loads(http: Request):
        # Request ids, rooms and peer URLs: the admin token's (the operator and `dsv4 up` send it).
        require_admin(http, args.admin_token)
        return {**await from_core("loads"), "http_waiting": serving.awaiting.count}

    add_kv_events_route(app, client, args, serving.model_name, lifecycle)
    add_session_routes(app, client, args)
    add_eplb_routes(app, client, args)

    @app.post(Paths.ADMIN_DRAIN)
    async def drain(http: Request):
        require_admin(http, args.admin_token)
        await from_core("drain")
        return {"draining": True}

    @app.post(Paths.ADMIN_ABORT)
    async def abort(http: Request):
        require_admin(http, args.admin_token)
        try:
            body = await http.json()
        except Exception:
            raise APIError('body must be JSON: {"rid": ...} or {"all": true}') from None
        if not isinstance(body, dict) or not (body.get("all") is True or isinstance(body.get("rid"), str)):
            raise APIError('give {"rid": "..."} or {"all": true}')
        try:
            client.abort(
                body.get("rid"), reason=str(body.get("reason", "aborted by admin")), all_=body.get("all") is True
            )
        except EngineGone as e:
            raise APIError(f"engine process unavailable: {e}", 503, "server_error") from None
        return {"aborted": body.get("rid") or "all"}

    @app.get(Paths.DEBUG_STACKS)
    async def stacks(http: Request):
        require_admin(http, args.admin_token)
        try:
            core = await client.ask("stacks", timeout=CORE_ANSWER_TIMEOUT)
        except (EngineGone, asyncio.TimeoutError) as e:
            core = f"(no answer: {str(e) or 'timed out'})\n"
        return PlainTextResponse(
            f"=== HTTP process (pid {os.getpid()}) ===\n{thread_stacks()}\n"
            f"=== engine core process (pid {client.pid}) ===\n{core}"
        )

    return app
