"""Thin async shell: fetch /metrics and /v1/loads of engines, return EngineSamples.

No decisions here; parsing lives in :mod:`dsv4_operator.watchdog.signals`.  An engine that answers neither endpoint in
time gives a sample with ``reachable=False`` (the detector decides what that means).

The HTTP client is aiohttp: measured on this project's machines against 127.0.0.1 servers,
an aiohttp GET costs ~0.17 ms of CPU, an httpx GET ~0.8 ms with a client per engine and several
ms with one shared client (httpcore's pool scans every connection for every request), which is
the whole 1 ms per pod per scrape budget of the watchdog (bench/suites/watchdog_scale.py).  An
``httpx.AsyncClient`` is still accepted by :func:`scrape_engine` for callers that have one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import time
from typing import Any, Callable, Iterable

import aiohttp
import yarl

from dsv4_wire import Paths

from ..bounded import LOADS_MAX_BYTES, METRICS_MAX_BYTES, BodyTooLarge, read_capped
from dsv4_operator.watchdog.signals import BUILTIN, SGLANG, EngineSample, ScrapeTarget, build_sample, parse_metrics_fast

LOADS_PATH = {BUILTIN: Paths.LOADS, SGLANG: Paths.LOADS + "?include=disagg"}


def _describe(url: str, exc: BaseException) -> str:
    detail = str(exc)
    return f"{url}: {type(exc).__name__}" + (f": {detail}" if detail else "")


@functools.lru_cache(maxsize=4096)
def _url(url: str) -> yarl.URL:
    return yarl.URL(url)  # parsed once per engine endpoint, not on every scrape


@functools.lru_cache(maxsize=64)
def _timeout(seconds: float) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=seconds)


async def _get_aiohttp(
    session: aiohttp.ClientSession, url: str, timeout: float, limit: int
) -> tuple[str | None, str | None]:
    try:
        async with session.get(_url(url), timeout=_timeout(timeout)) as resp:
            if resp.status != 200:
                return None, f"{url}: HTTP {resp.status}"
            body = await read_capped(resp, limit)
            return body.decode("utf-8", "replace"), None
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, BodyTooLarge) as exc:
        return None, _describe(url, exc)


async def _get_httpx(client: Any, url: str, timeout: float, limit: int) -> tuple[str | None, str | None]:
    import httpx

    try:
        async with client.stream("GET", url, timeout=timeout) as resp:
            if resp.status_code != 200:
                return None, f"{url}: HTTP {resp.status_code}"
            parts, size = [], 0
            async for chunk in resp.aiter_bytes():
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(limit)
                parts.append(chunk)
    except (httpx.HTTPError, BodyTooLarge) as exc:
        return None, _describe(url, exc)
    return b"".join(parts).decode("utf-8", "replace"), None


# Bodies up to this size are reduced on the event loop when the linear scan reads them (tens of
# microseconds); larger ones, and any the scan hands to the reference parser, go to a thread so
# one engine's body never holds up the operator's loop (lease renewal, /healthz, other scrapes).
INLINE_PARSE_BYTES = 64 << 10
_PARSE_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="dsv4-parse")


def _reduce(
    stamp: float,
    role: str,
    kind: str,
    base: str,
    metrics_text: str | None,
    loads_text: str | None,
    errors: list[str],
    *,
    inline: bool,
) -> EngineSample | None:
    """Both bodies -> a sample (pure).  ``inline``: None instead of any slow path."""
    metrics_values = None
    if metrics_text is not None and inline:
        metrics_values = parse_metrics_fast(metrics_text, kind)
        if metrics_values is None:
            return None
    loads = None
    if loads_text is not None:
        try:
            loads = json.loads(loads_text)
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than Python's stack
            errors = errors + [f"{base}/v1/loads: invalid JSON"]
    return build_sample(
        stamp,
        role,
        kind,
        metrics_text=metrics_text,
        loads=loads,
        error="; ".join(errors) or None,
        metrics_values=metrics_values,
    )


async def scrape_engine(
    client: aiohttp.ClientSession | Any,
    base_url: str,
    role: str,
    kind: str = BUILTIN,
    *,
    timeout: float = 2.0,
    clock: Callable[[], float] = time.time,
) -> EngineSample:
    """One scrape: both endpoints concurrently, each bounded by ``timeout`` seconds in all and
    by a byte cap.  ``client``: an aiohttp ClientSession (fast) or an httpx AsyncClient."""
    get = _get_aiohttp if isinstance(client, aiohttp.ClientSession) else _get_httpx
    base = base_url.rstrip("/")
    stamp = clock()
    # Both requests in flight at once; the loads request gets a task, /metrics runs in ours.
    loads_req = asyncio.ensure_future(get(client, base + LOADS_PATH.get(kind, Paths.LOADS), timeout, LOADS_MAX_BYTES))
    try:
        metrics_text, metrics_err = await get(client, base + Paths.METRICS, timeout, METRICS_MAX_BYTES)
    except BaseException:
        loads_req.cancel()
        raise
    loads_text, loads_err = await loads_req
    errors = [e for e in (metrics_err, loads_err) if e]
    size = len(metrics_text or "") + len(loads_text or "")
    if size <= INLINE_PARSE_BYTES:
        sample = _reduce(stamp, role, kind, base, metrics_text, loads_text, errors, inline=True)
        if sample is not None:
            return sample
    return await asyncio.get_running_loop().run_in_executor(
        _PARSE_POOL, functools.partial(_reduce, stamp, role, kind, base, metrics_text, loads_text, errors, inline=False)
    )


def make_session(concurrency: int = 64, headers: dict[str, str] | None = None) -> aiohttp.ClientSession:
    """A session for repeated scrape rounds: idle connections to every engine are kept between
    rounds (one keep-alive per endpoint), active ones bounded by the round's concurrency."""
    connector = aiohttp.TCPConnector(
        limit=max(2 * concurrency, 2), limit_per_host=0, keepalive_timeout=120.0, ttl_dns_cache=300
    )
    return aiohttp.ClientSession(
        connector=connector, trust_env=False, headers=headers, auto_decompress=True, raise_for_status=False
    )


async def scrape_all(
    targets: Iterable[ScrapeTarget],
    concurrency: int = 64,
    timeout: float = 2.0,
    *,
    client: aiohttp.ClientSession | Any = None,
    clock: Callable[[], float] = time.time,
) -> dict[str, EngineSample]:
    """Scrape every target, at most ``concurrency`` engines at a time.  Pass a long-lived
    ``client`` (see :func:`make_session`) to reuse connections across rounds."""
    pending = list(targets)
    pending.reverse()  # pop() from the end scrapes in the given order
    results: dict[str, EngineSample] = {}
    own = client is None
    if own:
        client = make_session(concurrency)

    # A fixed set of workers, each taking the next engine when done with one: no task and no
    # semaphore wait per engine.
    async def worker() -> None:
        while pending:
            t = pending.pop()
            results[t.key] = await scrape_engine(client, t.base_url, t.role, t.kind, timeout=timeout, clock=clock)

    try:
        await asyncio.gather(*(worker() for _ in range(max(min(concurrency, len(pending)), 1))))
    finally:
        if own:
            await client.close()
    return results
