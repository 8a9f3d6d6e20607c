"""Thin async shell: fetch /metrics and /v1/loads of engines, return EngineSamples.

No decisions here; parsing lives in :mod:`.signals`.  An engine that answers neither endpoint in
time gives a sample with ``reachable=False`` (the detector decides what that means).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import httpx

from .signals import BUILTIN, SGLANG, EngineSample, build_sample

LOADS_PATH = {BUILTIN: "/v1/loads", SGLANG: "/v1/loads?include=disagg"}


@dataclass(frozen=True)
class ScrapeTarget:
    key: str  # the pod's identity for the detector (include its UID: a new pod is a new key)
    base_url: str
    role: str
    kind: str = BUILTIN


async def _get_text(client: httpx.AsyncClient, url: str, timeout: float) -> tuple[str | None, str | None]:
    try:
        resp = await client.get(url, timeout=timeout)
    except httpx.HTTPError as exc:
        return None, f"{url}: {type(exc).__name__}: {exc}".rstrip(": ")
    if resp.status_code != 200:
        return None, f"{url}: HTTP {resp.status_code}"
    return resp.text, None


async def scrape_engine(client: httpx.AsyncClient, base_url: str, role: str,
                        kind: str = BUILTIN, *, timeout: float = 2.0,
                        clock: Callable[[], float] = time.time) -> EngineSample:
    """One scrape: both endpoints concurrently, each bounded by ``timeout`` seconds."""
    base = base_url.rstrip("/")
    stamp = clock()
    (metrics_text, metrics_err), (loads_text, loads_err) = await asyncio.gather(
        _get_text(client, base + "/metrics", timeout),
        _get_text(client, base + LOADS_PATH.get(kind, "/v1/loads"), timeout),
    )
    loads = None
    if loads_text is not None:
        try:
            loads = json.loads(loads_text)
        except ValueError:
            loads_err = f"{base}/v1/loads: invalid JSON"
    errors = "; ".join(e for e in (metrics_err, loads_err) if e) or None
    return build_sample(stamp, role, kind, metrics_text=metrics_text, loads=loads, error=errors)


def make_client(n_targets: int, concurrency: int = 64, timeout: float = 2.0) -> httpx.AsyncClient:
    """A client that keeps one idle connection per endpoint, so a scrape round reuses them
    instead of reconnecting to every pod each interval."""
    pool = max(2 * n_targets, 2 * concurrency, 10)
    return httpx.AsyncClient(
        timeout=timeout, trust_env=False,
        limits=httpx.Limits(max_connections=pool, max_keepalive_connections=pool,
                            keepalive_expiry=120.0))


async def scrape_all(targets: Iterable[ScrapeTarget], concurrency: int = 64,
                     timeout: float = 2.0, *, client: httpx.AsyncClient | None = None,
                     clock: Callable[[], float] = time.time) -> dict[str, EngineSample]:
    """Scrape every target, at most ``concurrency`` engines at a time."""
    targets = list(targets)
    gate = asyncio.Semaphore(max(concurrency, 1))
    own = client is None
    client = client or make_client(len(targets), concurrency, timeout)

    async def one(t: ScrapeTarget) -> tuple[str, EngineSample]:
        async with gate:
            return t.key, await scrape_engine(client, t.base_url, t.role, t.kind,
                                              timeout=timeout, clock=clock)

    try:
        results = await asyncio.gather(*(one(t) for t in targets))
    finally:
        if own:
            await client.aclose()
    return dict(results)
