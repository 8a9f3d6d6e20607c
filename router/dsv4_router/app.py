"""`dsv4 router`'s HTTP app and process: the OpenAI routes (handled by `router.Router`), health,
readiness, metrics and the admin calls on its workers.

Admin (/admin/workers): with an admin token, every call needs `Authorization: Bearer <token>`;
without one, only loopback clients (127.0.0.1, ::1) may call it, so a router bound to a public
address without a token cannot be handed workers by strangers.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from typing import Optional

import httpx
import uvicorn
from dsv4_wire.slow_clients import bounded
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from dsv4_router.agent_routes import add_agent_routes
from dsv4_router.cache_placement import Tokenize
from dsv4_router.router_args import RouterArgs
from dsv4_router.router import Router
from dsv4_router.body import parse_body, read_limited
from dsv4_router.fastlane import FastLane
from dsv4_router.sessions import delete_session as end_session
from dsv4_router.tenancy import KeyLimiter, TenantGate, TenantMetrics, salt_per_key
from dsv4_wire import APIError, Paths, admin_refusal
from dsv4_wire.api_keys import ApiKeyGate, KeyRing, caller_key

log = logging.getLogger("dsv4.router")


def _http_url(url: object) -> bool:
    """An http(s) URL a worker can be reached at (a malformed one is the caller's 400, not our 500)."""
    if not isinstance(url, str):
        return False
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL:
        return False
    return parsed.scheme in ("http", "https") and bool(parsed.host)


def build_app(router: Router) -> FastLane:
    """The router's ASGI app: the generation POSTs' fast lane in front of the FastAPI app."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="dsv4 router", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    async def _internal_error(_: Request, e: Exception):
        ref = uuid.uuid4().hex[:12]
        log.exception("router error (reference %s)", ref)
        return router.error(
            APIError(f"internal router error (reference {ref}: see the router's log)", 500, "server_error")
        )

    # who calls first (the key), then the key's limits and cache salt; the generation POSTs pass
    # the same gates (the same limits, metrics and keys) in front of the app (fastlane.py)
    tenancy = dict(
        limiter=KeyLimiter(router.args.key_limits),
        metrics=TenantMetrics(router.metrics.registry),
        salt_from_key=salt_per_key(bool(router.args.api_keys), router.args.shared_prefix_cache),
    )
    ring = KeyRing(router.args.api_keys)
    app.add_middleware(TenantGate, **tenancy)
    app.add_middleware(ApiKeyGate, ring=ring)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(http: Request, e: StarletteHTTPException):
        # unknown paths and methods answer in the OpenAI shape too
        msg = f"Invalid URL ({http.method} {http.url.path})" if e.status_code in (404, 405) else str(e.detail)
        return router.error(APIError(msg, e.status_code, "invalid_request_error"), dict(e.headers or {}))

    app.exception_handler(Exception)(_internal_error)

    def guard(http: Request) -> Optional[JSONResponse]:
        refusal = admin_refusal(http.headers, router.args.admin_token, http.client.host if http.client else None)
        if refusal is None:
            return None
        status, message = refusal
        return router.error(APIError(message, status, "authentication_error" if status == 401 else "permission_error"))

    async def admin_body(http: Request) -> dict | JSONResponse:
        try:
            return parse_body(await read_limited(http.headers.get("content-length"), http.stream(), 64 * 1024))
        except APIError as e:
            return router.error(e)
        except ClientDisconnect:
            return Response(status_code=499)

    @app.post(Paths.COMPLETIONS)
    async def completions(http: Request):
        return await router.handle(Paths.COMPLETIONS, http)

    @app.post(Paths.CHAT_COMPLETIONS)
    async def chat(http: Request):
        return await router.handle(Paths.CHAT_COMPLETIONS, http)

    add_agent_routes(app, router)

    @app.get(Paths.MODELS)
    async def models():
        for w in router.pool.workers.values():
            if w.healthy and w.role in ("decode", "mono"):
                try:
                    r = await router.up.control.get(w.url + Paths.MODELS)
                    return JSONResponse(r.json(), r.status_code)
                except (httpx.HTTPError, ValueError):
                    continue
        return router.error(
            APIError("no healthy engine is available", 503, "service_unavailable"), {"Retry-After": "2"}
        )

    @app.delete(Paths.SESSIONS + "/{session_id}")
    async def delete_session(session_id: str, http: Request):
        try:
            status, body = await end_session(
                router.up.control,
                list(router.pool.workers),
                session_id,
                http.query_params.get("cache_salt"),
                caller_key(http.scope),
                router.args.cache_salt_from_api_key,
            )
        except APIError as e:
            return router.error(e)
        return JSONResponse(body, status)

    @app.get(Paths.HEALTH)
    async def health():
        return {"status": "ok"}

    @app.get(Paths.READY)
    async def ready():
        try:
            router._pair(set())
        except APIError as e:
            return JSONResponse({"ready": False, "reason": e.message}, 503)
        return {"ready": True, "inflight": router.admission.inflight, "queued": router.admission.queued}

    @app.get(Paths.METRICS)
    async def metrics():
        return Response(generate_latest(router.metrics.registry), media_type="text/plain; version=0.0.4")

    @app.get(Paths.ADMIN_WORKERS)
    async def list_workers(http: Request):
        now = time.monotonic()
        return guard(http) or {
            "workers": [
                dict(
                    w.view(),
                    # what the router knows of its cache: indexed pages per tier, last event age
                    cache=dict(router.index.view(w.url, now), subscription=router.subscriber.status.get(w.url))
                    if router.subscriber is not None
                    else None,
                )
                for w in router.pool.workers.values()
            ]
        }

    @app.post(Paths.ADMIN_WORKERS)
    async def add_worker(http: Request):
        if (err := guard(http)) is not None:
            return err
        body = await admin_body(http)
        if isinstance(body, JSONResponse):
            return body
        if body.get("role") not in ("prefill", "decode", "mono") or not _http_url(body.get("url")):
            return router.error(APIError('give {"url": "http://host:port", "role": "prefill|decode|mono"}'))
        # Everything is checked before anything changes: a refused call leaves the pool as it was.
        if "canary" in body and (not isinstance(body["canary"], bool) or body["role"] == "prefill"):
            return router.error(APIError('"canary" is true or false, for a decode or mono worker'))
        share = body.get("canary_percent")
        if share is not None and (
            isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 100
        ):
            return router.error(APIError('"canary_percent" is a number from 0 to 100'))
        known = router.pool.workers.get(body["url"].rstrip("/"))
        canary = body.get("canary", known.canary if known is not None else False)
        if share and not canary:
            return router.error(APIError('"canary_percent" is for a canary: give "canary": true with it'))
        w = router.pool.add(body["url"], body["role"], source="admin")
        w.canary = canary
        if share is not None:
            w.canary_percent = float(share)
        if not w.canary:
            w.canary_percent = 0.0
        await router.health.check(w)
        return w.view()

    @app.delete(Paths.ADMIN_WORKERS)
    async def remove_worker(http: Request):
        if (err := guard(http)) is not None:
            return err
        body = await admin_body(http)
        if isinstance(body, JSONResponse):
            return body
        url = body.get("url")
        if not isinstance(url, str) or not router.pool.remove(url):
            return router.error(APIError(f"no such worker: {url}", 404, "not_found_error"))
        return {"removed": url}

    return FastLane(
        app,
        handle=router.handle,
        on_error=_internal_error,
        gates=lambda lane: ApiKeyGate(TenantGate(lane, **tenancy), ring=ring),
    )


def run_router(args: RouterArgs, tokenize: Optional[Tokenize] = None) -> None:
    """Serve the router; `tokenize` (the CLI's, from --tokenizer) turns text and chat prompts into
    the ids placement scores."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    router = Router(args)
    router.tokenize = tokenize
    print(
        f"dsv4 router on http://{args.host}:{args.port} "
        f"(prefill {len(args.prefill)}, decode {len(args.decode)}, mono {len(args.mono)}"
        f"{', discovering in ' + args.discover_namespace if args.discover_namespace else ''}; "
        f"up to {args.max_inflight} requests in flight, {args.max_queue} queued)",
        flush=True,
    )
    app, limits = bounded(build_app(router), args.client_timeout, args.max_connections)  # slow and many clients
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", **limits)
