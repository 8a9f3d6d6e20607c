"""The router's workers: each engine it routes to (`Worker`), the pool that picks the least busy
ready one (`WorkerPool`, prefix affinity within a load bound, canary shares), the health checks
that keep them in or out of rotation (`Health`, the rule itself pure: `health_after_check`), and
the router's metrics.

Health: a worker is in rotation while its own /ready says so. A request that cannot connect to
a worker takes it out until its next /ready check passes; so does one that waits far past the
stream's pace on a worker whose /ready then gets no answer (frozen, see stall.py); an HTTP error answer to a request
(a 4xx for bad input, a 5xx) never does. Workers that report draining leave the rotation; with
Kubernetes discovery, pods labelled serving.dsv4.dev/draining=true leave it too.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from dataclasses import dataclass
from typing import Optional

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

from dsv4_router.affinity import choose
from dsv4_router.upstream import BROKEN_CONNECTIONS, CONNECTION_FAILURES
from dsv4_wire import Paths

log = logging.getLogger("dsv4.router")


def _context_length(info: object) -> Optional[int]:
    n = info.get("max_model_len") if isinstance(info, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


@dataclass
class Worker:
    url: str
    role: str  # prefill | decode | mono
    healthy: bool = False
    reason: str = "not checked yet"
    bootstrap_port: Optional[int] = None
    inflight: int = 0
    failures: int = 0  # consecutive /ready checks that got no answer
    source: str = "static"  # static | admin | kubernetes
    # A canary (a rollout's first engine on the new revision): out of the normal rotation, it
    # serves requests pinned to it (PIN_HEADER, admin), e.g. the rollout probe's, and
    # `canary_percent` percent of its role's live requests (the rollout's trafficPercent).
    canary: bool = False
    canary_percent: float = 0.0
    load_tokens: int = 0  # prompt tokens of this router's requests in flight here (cache placement's load)
    max_model_len: Optional[int] = None  # its context length, from /server_info (the default body limit)
    info_read: bool = False  # /server_info asked once (an engine without it says nothing more later)

    @property
    def host(self) -> str:
        return httpx.URL(self.url).host

    def view(self) -> dict:
        return {
            "url": self.url,
            "role": self.role,
            "healthy": self.healthy,
            "reason": self.reason,
            "inflight": self.inflight,
            "bootstrap_port": self.bootstrap_port,
            "source": self.source,
            "canary": self.canary,
            "canary_percent": self.canary_percent,
            "load_tokens": self.load_tokens,
        }


# worker leaves the rotation: an engine busy for a moment is not a dead one.
UNANSWERED_CHECKS = 3


def health_after_check(w: Worker, status: Optional[int], reason: str, refused: bool) -> tuple[bool, str, int]:
    """(healthy, reason, failures) after one /ready check. Pure.

    status: the HTTP status /ready answered, or None when there was no answer; refused: the
    connection itself failed (the process is gone), which takes the worker out at once."""
    if status == 200:
        return True, "ready", 0
    if status is not None:
        return False, reason or f"/ready answered {status}", 0
    failures = w.failures + 1
    if refused or failures >= UNANSWERED_CHECKS or not w.healthy:
        return False, reason, failures
    return w.healthy, w.reason, failures


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("dsv4_router:requests", "Requests received", ["endpoint"], registry=self.registry)
        self.errors = Counter(
            "dsv4_router:errors", "Requests answered with an error", ["status"], registry=self.registry
        )
        self.retries = Counter("dsv4_router:retries", "Requests retried on another pair", registry=self.registry)
        self.worker_requests = Counter(
            "dsv4_router:worker_requests", "Requests sent per worker", ["worker", "role"], registry=self.registry
        )
        self.worker_healthy = Gauge(
            "dsv4_router:worker_healthy", "1 when the worker is in rotation", ["worker", "role"], registry=self.registry
        )
        self.inflight = Gauge(
            "dsv4_router:inflight_requests", "Requests holding an admission slot", registry=self.registry
        )
        self.queued = Gauge(
            "dsv4_router:queued_requests", "Requests waiting for an admission slot", registry=self.registry
        )
        self.rejected = Counter(
            "dsv4_router:rejected", "Requests refused with 429 (router at its limit)", registry=self.registry
        )
        self.migrations = Counter(
            "dsv4:router_migrations",
            "Requests re-sent to another engine after a failure, by why",
            ["reason"],
            registry=self.registry,
        )
        # per request: the labelled children are looked up once per label values, not built
        # again each time (prometheus_client's labels() locks and hashes on every call)
        self.requests_of = functools.lru_cache(maxsize=256)(self.requests.labels)
        self.worker_requests_of = functools.lru_cache(maxsize=4096)(self.worker_requests.labels)


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

    def pick(
        self,
        role: str,
        exclude: set[str] = frozenset(),
        key: Optional[str] = None,
        draw: Optional[float] = None,
        placed=None,
    ) -> Optional[Worker]:
        """The least busy ready worker of a role; with a key (prefix affinity, see affinity.py),
        the one the key prefers unless it is much busier than the least busy. A ready canary
        with a traffic share takes that share of the picks (`draw`: a number in [0, 100), random
        when not given)."""
        canaries = [
            w
            for w in self.workers.values()
            if w.role == role and w.healthy and w.canary and w.canary_percent > 0 and w.url not in exclude
        ]
        if canaries:
            draw = random.uniform(0.0, 100.0) if draw is None else draw
            for w in canaries:
                if draw < w.canary_percent:
                    return w
                draw -= w.canary_percent
        ready = [
            w for w in self.workers.values() if w.role == role and w.healthy and not w.canary and w.url not in exclude
        ]
        if not ready:
            ready = [w for w in self.workers.values() if w.role == role and w.healthy and not w.canary]
        if not ready:
            return None
        if placed is not None:  # by what each engine holds (cache_placement.py), when it is known
            w = placed(ready)
            if w is not None:
                return w
        if key is not None:
            url = choose(key, {w.url: w.inflight for w in ready})
            return next(w for w in ready if w.url == url)
        least = min(w.inflight for w in ready)
        return random.choice([w for w in ready if w.inflight == least])


class Health:
    """The /ready checks that keep workers in or out of rotation: a round every `interval` seconds,
    a check at once for a worker whose connection broke mid-answer, and a worker out at once when
    a request cannot connect to it."""

    def __init__(self, interval: float, pool: WorkerPool, metrics: RouterMetrics) -> None:
        self.interval = interval
        self.pool = pool
        self.metrics = metrics
        self.control: Optional[httpx.AsyncClient] = None  # the control pool (Upstreams.control), set at start
        self.checking: dict[str, asyncio.Task] = {}

    # ---- health ----------------------------------------------------------------------------------

    async def loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.check_all()
            except Exception:
                log.exception("health check round failed")

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in list(self.pool.workers.values())))

    async def check(self, w: Worker) -> None:
        """One /ready check on the control pool (never behind request traffic)."""
        status: Optional[int] = None
        reason, refused = "", False
        try:
            r = await self.control.get(w.url + Paths.READY)
            status = r.status_code
            if status == 200 and w.role == "prefill" and w.bootstrap_port is None:
                info = (await self.control.get(w.url + Paths.SERVER_INFO)).json()
                w.bootstrap_port = info.get("bootstrap_port")
                w.max_model_len = _context_length(info)
            elif status == 200 and not w.info_read:
                w.info_read = True
                try:  # only for the default body limit: an engine without /server_info stays healthy
                    w.max_model_len = _context_length((await self.control.get(w.url + Paths.SERVER_INFO)).json())
                except (httpx.HTTPError, ValueError):
                    pass
            elif status != 200 and r.headers.get("content-type", "").startswith("application/json"):
                body = r.json()
                reason = str(body.get("reason", "")) if isinstance(body, dict) else ""
        except CONNECTION_FAILURES as e:
            reason, refused = f"unreachable: {type(e).__name__}", True
        except (httpx.HTTPError, ValueError) as e:
            status, reason = None, f"no answer to /ready: {type(e).__name__}"
        w.healthy, w.reason, w.failures = health_after_check(w, status, reason, refused)
        self.metrics.worker_healthy.labels(w.url, w.role).set(1 if w.healthy else 0)

    async def frozen(self, w: Worker) -> bool:
        """A request on `w` has waited far past its pace (stall.py): check it now. Frozen when
        it does not answer (then out of rotation at once, not after UNANSWERED_CHECKS: a request
        is known to be stuck on it) or answers that it is not ready."""
        before = w.failures
        await self.check(w)
        if w.failures > before:
            self.mark_failed(w, f"frozen: no answer to /ready while a request on it stalled ({w.reason})")
        return not w.healthy

    def check_soon(self, w: Worker) -> None:
        """A connection broke mid-answer: check that worker now rather than at the next round."""
        if w.url not in self.checking:
            t = asyncio.create_task(self.check(w))
            self.checking[w.url] = t
            t.add_done_callback(lambda _: self.checking.pop(w.url, None))

    def mark_failed(self, w: Worker, reason: str) -> None:
        """A request could not connect: out of rotation until /ready says otherwise."""
        w.healthy, w.reason = False, reason
        self.metrics.worker_healthy.labels(w.url, w.role).set(0)

    def connection_failed(self, w: Worker, e: Exception) -> None:
        if isinstance(e, CONNECTION_FAILURES):
            self.mark_failed(w, f"request failed: {type(e).__name__}")
        elif isinstance(e, BROKEN_CONNECTIONS):
            self.check_soon(w)
