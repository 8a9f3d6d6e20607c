"""Per-tenant rules at the router: who may call (API keys, dsv4_wire.api_keys), how much each key
may ask at once and per second (429 with Retry-After for that key only, never for the others),
and which prefix-cache namespace its requests use (``cache_salt`` derived from the key).

The key is the tenant: every limit and metric is per key, labelled with the key's configured
name or a short hash of it (``key-<12 hex>``), never the key. Requests without keys (no
``--api-key`` configured) share one tenant, ``anonymous``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge

from dsv4_wire import APIError, Paths
from dsv4_wire.paths import ANTHROPIC_PATHS
from dsv4_wire.agent_apis.messages_output import error_body
from dsv4_wire.api_keys import ApiKey, caller_key

ANONYMOUS = "anonymous"
GENERATION_PATHS = frozenset({Paths.COMPLETIONS, Paths.CHAT_COMPLETIONS, Paths.RESPONSES, Paths.MESSAGES})
SALT_SCOPE_KEY = "dsv4.cache_salt"
ADMIT_SCOPE_KEY = "dsv4.key_admit"


@dataclass(frozen=True)
class TenantLimits:
    max_concurrency: int = 0  # requests of one key in flight at once (0: no limit)
    rate: float = 0.0  # requests per second per key, sustained (0: no limit)
    burst: float = 0.0  # requests one key may send at once above the rate (default: max(1, rate))

    @property
    def bucket(self) -> float:
        return self.burst if self.burst > 0 else max(1.0, self.rate)

    @property
    def active(self) -> bool:
        return self.max_concurrency > 0 or self.rate > 0


@dataclass
class _KeyState:
    inflight: int = 0
    tokens: float = 0.0
    stamp: float = 0.0


class KeyLimiter:
    """Concurrency and a token bucket per key. Pure apart from the clock it is given."""

    def __init__(self, limits: TenantLimits):
        self.limits = limits
        self.keys: dict[str, _KeyState] = {}

    def _state(self, key: str, now: float) -> _KeyState:
        st = self.keys.get(key)
        if st is None:
            st = self.keys[key] = _KeyState(tokens=self.limits.bucket, stamp=now)
        if self.limits.rate > 0:
            st.tokens = min(self.limits.bucket, st.tokens + (now - st.stamp) * self.limits.rate)
            st.stamp = now
        return st

    def over(self, key: str, now: float) -> Optional[tuple[str, int]]:
        """Whether the key is at a limit already (checked at the door, before the body is read);
        nothing is charged."""
        lim, st = self.limits, self._state(key, now)
        if lim.max_concurrency and st.inflight >= lim.max_concurrency:
            return "concurrency", 1
        if lim.rate > 0 and st.tokens < 1.0:
            return "rate", max(1, math.ceil((1.0 - st.tokens) / lim.rate))
        return None

    def admit(self, key: str, now: float, sequences: int = 1) -> Optional[tuple[str, int]]:
        """None: admitted (release() it when done); else (why, seconds to wait). A request
        counts its sequences (issue 39: prompts x n), in flight and against the rate; one alone
        in flight is always let in, and one larger than the bucket leaves the key in debt."""
        lim, st = self.limits, self._state(key, now)
        if lim.max_concurrency and st.inflight and st.inflight + sequences > lim.max_concurrency:
            return "concurrency", 1
        if lim.rate > 0:
            need = min(float(sequences), lim.bucket)
            if st.tokens < need:
                return "rate", max(1, math.ceil((need - st.tokens) / lim.rate))
            st.tokens -= sequences
        st.inflight += sequences
        return None

    def release(self, key: str, sequences: int = 1) -> None:
        st = self.keys.get(key)
        if st is not None:
            st.inflight = max(0, st.inflight - sequences)

    def inflight(self, key: str) -> int:
        st = self.keys.get(key)
        return st.inflight if st else 0


def salt_per_key(has_keys: bool, shared_prefix_cache: bool) -> bool:
    """Whether each key gets its own cache namespace: yes whenever keys are configured (issue 39:
    else a key's cached_tokens says whether another key's prompt prefix is cached), unless the
    operator opts out with --shared-prefix-cache."""
    return has_keys and not shared_prefix_cache


def derived_salt(key: ApiKey, client_salt: Optional[str]) -> str:
    """The cache namespace of a key's requests. A client's own salt subdivides its key's
    namespace and can never name another key's (the key's hash comes first)."""
    own = "k" + hashlib.sha256(b"dsv4-cache-salt\0" + key.key.encode()).hexdigest()[:32]
    return f"{own}:{client_salt}" if client_salt else own


def apply_cache_salt(body: dict, scope: dict) -> None:
    """The router's hook after parsing a body: the salt derived from the caller's key, if any."""
    salt = scope.get(SALT_SCOPE_KEY)
    if salt is not None:
        client = body.get("cache_salt")
        body["cache_salt"] = salt(client if isinstance(client, str) else None)


class TenantMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter(
            "dsv4_router:key_requests",
            "Generation requests per API key (name or key-<hash>) "
            "and result: admitted, or refused for concurrency or rate",
            ["key", "result"],
            registry=registry,
        )
        self.inflight = Gauge(
            "dsv4_router:key_inflight_requests", "Generation requests in flight per API key", ["key"], registry=registry
        )
        # the children per label values, looked up once (labels() locks and hashes every call)
        self.requests_of = functools.lru_cache(maxsize=4096)(self.requests.labels)
        self.inflight_of = functools.lru_cache(maxsize=4096)(self.inflight.labels)


class TenantGate:
    """ASGI middleware inside dsv4_wire.api_keys.ApiKeyGate (which left the caller's key in the
    scope): per-key limits and the derived cache salt on generation requests."""

    def __init__(
        self,
        app,
        limiter: KeyLimiter,
        metrics: TenantMetrics,
        salt_from_key: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.app = app
        self.limiter = limiter
        self.metrics = metrics
        self.salt_from_key = salt_from_key
        self.clock = clock

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        key: Optional[ApiKey] = caller_key(scope)
        name = key.name if key is not None else ANONYMOUS
        held = [0]  # sequences charged to the key (once the router has parsed the body)
        if self.limiter.limits.active:
            refused = self.limiter.over(name, self.clock())
            if refused is not None:
                why, wait = refused
                self.metrics.requests_of(name, why).inc()
                return await _too_many(send, why, wait, scope["path"])

            def admit(sequences: int) -> Optional[APIError]:
                refused = self.limiter.admit(name, self.clock(), sequences)
                if refused is not None:
                    self.metrics.requests_of(name, refused[0]).inc()
                    return key_limit_error(*refused)
                self.metrics.requests_of(name, "admitted").inc()
                held[0] = sequences
                return None

            scope[ADMIT_SCOPE_KEY] = admit
        else:
            self.metrics.requests_of(name, "admitted").inc()
        if self.salt_from_key and key is not None:
            scope[SALT_SCOPE_KEY] = lambda client, k=key: derived_salt(k, client)
        gauge = self.metrics.inflight_of(name)
        gauge.inc()
        try:
            await self.app(scope, receive, send)  # returns once the response (a stream too) is sent
        finally:
            gauge.dec()
            if held[0]:
                self.limiter.release(name, held[0])


def admit_sequences(scope: dict, sequences: int) -> Optional[APIError]:
    """The router's hook after parsing a body: charge the caller's key for the request's
    sequences. None: go on; else the 429 to answer."""
    admit = scope.get(ADMIT_SCOPE_KEY)
    return admit(sequences) if admit is not None else None


def key_limit_error(why: str, wait: int) -> APIError:
    what = "requests in flight" if why == "concurrency" else "requests per second"
    e = APIError(
        f"this API key is at its limit of {what} (a request counts its prompts x n); retry after {wait}s",
        429,
        "rate_limit_exceeded",
        code=f"key_{why}_limit",
    )
    e.retry_after = wait
    return e


async def _too_many(send, why: str, wait: int, path: str) -> None:
    e = key_limit_error(why, wait)
    # Anthropic's route answers in Anthropic's shape
    body = json.dumps(error_body(429, e.message) if path in ANTHROPIC_PATHS else e.body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 429,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", str(wait).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
