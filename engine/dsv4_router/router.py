"""The PD router: the OpenAI API in front of prefill + decode (or monolithic) engines.

Each request gets a prefill and a decode worker (least busy, by the router's own count of
requests in flight) and a random bootstrap room, and goes to both at once; the client reads the
decode's answer. A request that fails before its first byte is retried once on another pair.
Workers that fail /ready checks or report draining leave the rotation; with Kubernetes
discovery, pods labelled serving.dsv4.dev/draining=true leave it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from dsv4_wire import APIError, Paths, token_matches

log = logging.getLogger("dsv4.router")


@dataclass
class RouterArgs:
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    mono: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    discover_namespace: Optional[str] = None
    selector: Optional[str] = None
    health_interval: float = 2.0
    admin_token: Optional[str] = None
    pd_secret: Optional[str] = None  # sent with internal requests to prefill/decode engines
    request_timeout: float = 600.0


@dataclass
class Worker:
    url: str
    role: str  # prefill | decode | mono
    healthy: bool = False
    reason: str = "not checked yet"
    bootstrap_port: Optional[int] = None
    inflight: int = 0
    failures: int = 0
    source: str = "static"  # static | admin | kubernetes

    @property
    def host(self) -> str:
        return httpx.URL(self.url).host

    def view(self) -> dict:
        return {"url": self.url, "role": self.role, "healthy": self.healthy, "reason": self.reason,
                "inflight": self.inflight, "bootstrap_port": self.bootstrap_port, "source": self.source}


@dataclass
class Retry:
    """An attempt that failed before the client saw a byte: what the engine said, if anything."""

    status: int
    content: bytes


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("dsv4_router:requests", "Requests received", ["endpoint"], registry=self.registry)
        self.errors = Counter("dsv4_router:errors", "Requests answered with an error", ["status"], registry=self.registry)
        self.retries = Counter("dsv4_router:retries", "Requests retried on another pair", registry=self.registry)
        self.worker_requests = Counter("dsv4_router:worker_requests", "Requests sent per worker", ["worker", "role"], registry=self.registry)
        self.worker_healthy = Gauge("dsv4_router:worker_healthy", "1 when the worker is in rotation", ["worker", "role"], registry=self.registry)


class WorkerPool:
    def __init__(self) -> None:
        self.workers: dict[str, Worker] = {}

    def add(self, url: str, role: str, source: str = "static") -> Worker:
        url = url.rstrip("/")
        w = self.workers.get(url)
        if w is None or w.role != role:
            w = self.workers[url] = Worker(url, role, source=source)
        return w

    def remove(self, url: str) -> bool:
        return self.workers.pop(url.rstrip("/"), None) is not None

    def pick(self, role: str, exclude: set[str] = frozenset()) -> Optional[Worker]:
        ready = [w for w in self.workers.values() if w.role == role and w.healthy and w.url not in exclude]
        if not ready:
            ready = [w for w in self.workers.values() if w.role == role and w.healthy]
        if not ready:
            return None
        least = min(w.inflight for w in ready)
        return random.choice([w for w in ready if w.inflight == least])


class Router:
    def __init__(self, args: RouterArgs):
        self.args = args
        self.pool = WorkerPool()
        for u in args.prefill:
            self.pool.add(u, "prefill")
        for u in args.decode:
            self.pool.add(u, "decode")
        for u in args.mono:
            self.pool.add(u, "mono")
        self.metrics = RouterMetrics()
        self.client: Optional[httpx.AsyncClient] = None
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.args.request_timeout, connect=5.0))
        await self.check_all()
        self._tasks.append(asyncio.create_task(self._health_loop()))
        if self.args.discover_namespace:
            from dsv4_router.discovery import watch_pods

            self._tasks.append(asyncio.create_task(watch_pods(self, self.args.discover_namespace, self.args.selector)))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self.client:
            await self.client.aclose()

    # ---- health ----------------------------------------------------------------------------------

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.args.health_interval)
            try:
                await self.check_all()
            except Exception:
                log.exception("health check round failed")

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in list(self.pool.workers.values())))

    async def check(self, w: Worker) -> None:
        try:
            r = await self.client.get(w.url + Paths.READY, timeout=3.0)
            body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
            if r.status_code == 200:
                if w.role == "prefill" and w.bootstrap_port is None:
                    info = (await self.client.get(w.url + Paths.SERVER_INFO, timeout=3.0)).json()
                    w.bootstrap_port = info.get("bootstrap_port")
                w.healthy, w.reason, w.failures = True, "ready", 0
            else:
                w.healthy, w.reason = False, str(body.get("reason", f"/ready answered {r.status_code}"))
        except Exception as e:
            w.failures += 1
            if w.failures >= 2 or not w.healthy:
                w.healthy, w.reason = False, f"unreachable: {type(e).__name__}"
        self.metrics.worker_healthy.labels(w.url, w.role).set(1 if w.healthy else 0)

    def mark_failed(self, w: Worker, reason: str) -> None:
        """A connection failure in a live request: out of rotation until /ready says otherwise."""
        w.healthy, w.reason = False, reason
        self.metrics.worker_healthy.labels(w.url, w.role).set(0)

    # ---- requests --------------------------------------------------------------------------------

    def _pair(self, exclude: set[str]) -> tuple[Optional[Worker], Worker]:
        if any(w.role == "prefill" for w in self.pool.workers.values()):
            p, d = self.pool.pick("prefill", exclude), self.pool.pick("decode", exclude)
            if p is None or d is None or p.bootstrap_port is None:
                raise APIError("no healthy prefill/decode pair is available", 503, "service_unavailable")
            return p, d
        m = self.pool.pick("mono", exclude)
        if m is None:
            raise APIError("no healthy engine is available", 503, "service_unavailable")
        return None, m

    async def handle(self, path: str, http: Request) -> Response:
        self.metrics.requests.labels(path).inc()
        try:
            body = json.loads(await http.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return self._error(APIError(f"request body is not valid JSON: {e}"))
        if not isinstance(body, dict):
            return self._error(APIError("request body must be a JSON object"))
        # A client that hangs up cancels the attempt: closing the upstream connections is what
        # makes the engines abort (and, through them, the PD peer).
        work = asyncio.ensure_future(self._route(path, body))
        gone = asyncio.ensure_future(self._wait_disconnect(http))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if work.done():
            return work.result()
        work.cancel()
        return Response(status_code=499)

    @staticmethod
    async def _wait_disconnect(http: Request) -> None:
        while not await http.is_disconnected():
            await asyncio.sleep(0.05)

    async def _route(self, path: str, body: dict) -> Response:
        rid = body.get("rid") or f"{'chatcmpl' if 'chat' in path else 'cmpl'}-{uuid.uuid4().hex}"
        tried: set[str] = set()
        last: Optional[Retry] = None
        for attempt in range(2):
            try:
                p, d = self._pair(tried)
            except APIError as e:
                return self._error(e)
            tried.update({d.url} | ({p.url} if p else set()))
            if attempt:
                self.metrics.retries.inc()
            result = await self._attempt(path, body, rid if not attempt else f"{rid}-r{attempt}", p, d)
            if not isinstance(result, Retry):
                return result
            last = result
        if last is not None and last.content:
            self.metrics.errors.labels(str(last.status)).inc()
            return Response(last.content, last.status, media_type="application/json")
        return self._error(APIError("the request failed on two prefill/decode pairs; see the engines' logs", 503, "service_unavailable"))

    def _error(self, e: APIError) -> JSONResponse:
        self.metrics.errors.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    async def _attempt(self, path: str, body: dict, rid: str, p: Optional[Worker], d: Worker) -> "Response | Retry":
        """One try on one pair; Retry means it failed before the first byte."""
        body = dict(body, rid=rid)
        prefill_task = None
        if p is not None:
            room = random.getrandbits(63)
            body.update(bootstrap_host=p.host, bootstrap_port=p.bootstrap_port, bootstrap_room=room)
            prefill_task = asyncio.create_task(self._prefill(path, dict(body, stream=False), p))
        d.inflight += 1
        self.metrics.worker_requests.labels(d.url, d.role).inc()
        handed_off = False
        try:
            req = self.client.build_request("POST", f"{d.url}{path}", json=body)
            try:
                resp = await self.client.send(req, stream=True)
            except httpx.HTTPError as e:
                self.mark_failed(d, f"request failed: {type(e).__name__}")
                return Retry(502, b"")
            if resp.status_code != 200:
                content = await resp.aread()
                await resp.aclose()
                if 400 <= resp.status_code < 500:
                    self.metrics.errors.labels(str(resp.status_code)).inc()
                    return Response(content, resp.status_code, media_type="application/json")
                return Retry(resp.status_code, content)
            if body.get("stream"):
                chunks = resp.aiter_raw()
                first = await self._first_event(chunks)
                event = first.split(b"\n\n", 1)[0]
                if not event.startswith(b"data: ") or b'"error"' in event:
                    # failed before producing anything (e.g. the KV transfer): another pair may do
                    await resp.aclose()
                    return Retry(502, event[6:] if event.startswith(b"data: ") else b"")
                handed_off = True
                return StreamingResponse(self._relay(first, chunks, resp, d), media_type="text/event-stream")
            content = await resp.aread()
            await resp.aclose()
            return Response(content, 200, media_type="application/json")
        except asyncio.CancelledError:
            raise
        finally:
            if not handed_off:
                d.inflight -= 1
            if prefill_task is not None and not prefill_task.done():
                prefill_task.cancel()  # closing the connection aborts the request on prefill

    async def _prefill(self, path: str, body: dict, p: Worker) -> tuple[int, bytes]:
        p.inflight += 1
        self.metrics.worker_requests.labels(p.url, p.role).inc()
        try:
            r = await self.client.post(f"{p.url}{path}", json=body)
            return r.status_code, r.content
        except httpx.HTTPError as e:
            self.mark_failed(p, f"request failed: {type(e).__name__}")
            return 502, b""
        finally:
            p.inflight -= 1

    @staticmethod
    async def _first_event(chunks: AsyncIterator[bytes]) -> bytes:
        buf = b""
        async for chunk in chunks:
            buf += chunk
            if b"\n\n" in buf:
                break
        return buf

    async def _relay(self, first: bytes, chunks: AsyncIterator[bytes], resp: httpx.Response, d: Worker) -> AsyncIterator[bytes]:
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        finally:
            d.inflight -= 1
            await resp.aclose()  # a client that left closes the decode stream: decode aborts


def build_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="dsv4 router", docs_url=None, redoc_url=None, lifespan=lifespan)

    def guard(http: Request) -> Optional[JSONResponse]:
        if not token_matches(http.headers, router.args.admin_token):
            return router._error(APIError("admin token required", 401, "authentication_error"))
        return None

    @app.post(Paths.COMPLETIONS)
    async def completions(http: Request):
        return await router.handle(Paths.COMPLETIONS, http)

    @app.post(Paths.CHAT_COMPLETIONS)
    async def chat(http: Request):
        return await router.handle(Paths.CHAT_COMPLETIONS, http)

    @app.get(Paths.MODELS)
    async def models():
        for w in router.pool.workers.values():
            if w.healthy and w.role in ("decode", "mono"):
                try:
                    r = await router.client.get(w.url + Paths.MODELS, timeout=3.0)
                    return JSONResponse(r.json(), r.status_code)
                except httpx.HTTPError:
                    continue
        return router._error(APIError("no healthy engine is available", 503, "service_unavailable"))

    @app.get(Paths.HEALTH)
    async def health():
        return {"status": "ok"}

    @app.get(Paths.READY)
    async def ready():
        try:
            router._pair(set())
        except APIError as e:
            return JSONResponse({"ready": False, "reason": e.message}, 503)
        return {"ready": True}

    @app.get(Paths.METRICS)
    async def metrics():
        return Response(generate_latest(router.metrics.registry), media_type="text/plain; version=0.0.4")

    @app.get(Paths.ADMIN_WORKERS)
    async def list_workers(http: Request):
        return guard(http) or {"workers": [w.view() for w in router.pool.workers.values()]}

    @app.post(Paths.ADMIN_WORKERS)
    async def add_worker(http: Request):
        if (err := guard(http)) is not None:
            return err
        body = await http.json()
        if not isinstance(body, dict) or body.get("role") not in ("prefill", "decode", "mono") or not isinstance(body.get("url"), str):
            return router._error(APIError('give {"url": "http://host:port", "role": "prefill|decode|mono"}'))
        w = router.pool.add(body["url"], body["role"], source="admin")
        await router.check(w)
        return w.view()

    @app.delete(Paths.ADMIN_WORKERS)
    async def remove_worker(http: Request):
        if (err := guard(http)) is not None:
            return err
        body = await http.json()
        url = body.get("url") if isinstance(body, dict) else None
        if not isinstance(url, str) or not router.pool.remove(url):
            return router._error(APIError(f"no such worker: {url}", 404, "not_found"))
        return {"removed": url}

    return app


def run_router(args: RouterArgs) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    router = Router(args)
    print(f"dsv4 router on http://{args.host}:{args.port} "
          f"(prefill {len(args.prefill)}, decode {len(args.decode)}, mono {len(args.mono)}"
          f"{', discovering in ' + args.discover_namespace if args.discover_namespace else ''})", flush=True)
    uvicorn.run(build_app(router), host=args.host, port=args.port, log_level="warning")
