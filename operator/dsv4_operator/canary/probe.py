"""Run the probe against one engine: `concurrency` replayed conversations (conversation.py), each
sent round by round as streamed completions, for `duration_s`; a request still unanswered
`request_timeout_s` after it was sent counts as stalled. Meanwhile the watchdog's detector reads
the engine (its /metrics and /v1/loads), and its KV pages are counted idle before and after.

The probe reaches the engine through the router with the pin header (PIN_HEADER: the canary is
out of the normal rotation; a decode needs the router to pair it with a prefill), or directly
(`url` = the engine, `pin` = None) for a monolithic engine."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx

from dsv4_wire import Paths, authorization_header

from dsv4_operator.canary.conversation import ConversationShape, context_target, rounds
from dsv4_operator.canary.verdict import ProbeFigures, WatchdogSignals
from dsv4_operator.watchdog.detector import Detector, Wedged
from dsv4_operator.remediation.scrape import scrape_engine

PIN_HEADER = "x-dsv4-pin-worker"  # the router's (dsv4_router.router.PIN_HEADER)


@dataclass(frozen=True)
class ProbeSettings:
    shape: ConversationShape = field(default_factory=ConversationShape)
    concurrency: int = 2
    duration_s: float = 60.0  # no new request after this; in-flight ones get request_timeout_s
    request_timeout_s: float = 20.0
    wedge_window_s: float = 10.0  # the detector's window while probing (shorter than the fleet's)
    scrape_interval_s: float = 1.0
    settle_s: float = 10.0  # after the probe: how long the engine may take to be idle again
    seed: int = 0


def percentile(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class _Tally:
    requests: int = 0
    errors: int = 0
    stalled: int = 0
    ttfts: list = field(default_factory=list)
    gaps: list = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    max_context: int = 0
    first_error: Optional[str] = None

    def error(self, why: str) -> None:
        self.errors += 1
        self.first_error = self.first_error or why


async def _one(
    client: httpx.AsyncClient, url: str, headers: dict, prompt: list[int], max_tokens: int, tally: _Tally
) -> bool:
    """One streamed round; True when it got its whole answer."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    sent = time.monotonic()
    last: Optional[float] = None
    tokens = 0
    async with client.stream("POST", url + Paths.COMPLETIONS, json=body, headers=headers) as r:
        if r.status_code != 200:
            tally.error(f"HTTP {r.status_code}: {(await r.aread())[:200].decode(errors='replace')}")
            return False
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                tally.error(str(chunk["error"].get("message", chunk["error"]))[:200])
                return False
            now = time.monotonic()
            if any(c.get("text") for c in chunk.get("choices", [])):
                tokens += 1
                if last is None:
                    tally.ttfts.append(now - sent)
                else:
                    tally.gaps.append(now - last)
                last = now
    tally.prompt_tokens += len(prompt)
    tally.completion_tokens += tokens
    tally.max_context = max(tally.max_context, len(prompt))
    return True


async def watch_engine(
    engine_url: str,
    role: str,
    settings: ProbeSettings,
    stop: asyncio.Event,
    wedged: list,
    headers: Optional[dict] = None,
) -> None:
    """The watchdog's detector on the canary while the probe runs: its first Wedged reason.
    `headers`: the admin token (/v1/loads is behind it)."""
    detector = Detector(window_s=settings.wedge_window_s)
    async with httpx.AsyncClient(headers=headers) as client:
        while not stop.is_set():
            verdict = detector.observe("canary", await scrape_engine(client, engine_url, role), answered_before=True)
            if isinstance(verdict, Wedged) and not wedged:
                wedged.append(verdict.reason)
            try:
                await asyncio.wait_for(stop.wait(), settings.scrape_interval_s)
            except asyncio.TimeoutError:
                pass


async def kv_pages(
    client: httpx.AsyncClient, engine_url: str, idle_within: float = 0.0
) -> tuple[Optional[float], Optional[float]]:
    """(free, total) KV pages, read once the engine is idle; free is None when it did not idle
    within `idle_within` seconds (the only replica of a role keeps its live traffic while it is
    the canary: pages its clients hold are no leak, so the leak check is left out)."""
    deadline = time.monotonic() + idle_within
    loads: dict = {}
    while True:
        try:
            loads = (await client.get(engine_url + Paths.LOADS, timeout=5.0)).json()
        except (httpx.HTTPError, ValueError):
            loads = {}
        busy = sum(v for v in (loads.get("queues") or {}).values() if isinstance(v, (int, float)))
        if loads and busy == 0:
            return loads.get("kv_pages_free"), loads.get("kv_pages_total")
        if time.monotonic() >= deadline:
            return None, loads.get("kv_pages_total")
        await asyncio.sleep(0.2)


async def run_probe(
    url: str,
    engine_url: str,
    role: str,
    settings: ProbeSettings,
    *,
    pin: Optional[str] = None,
    admin_token: Optional[str] = None,
    router_token: Optional[str] = None,
    max_model_len: Optional[int] = None,
) -> tuple[ProbeFigures, WatchdogSignals]:
    """The probe against the engine at `engine_url`, sent to `url` (the router, with `pin`, or the
    engine itself). Bounded: duration_s + request_timeout_s + settle_s at most.
    Two tokens, since a router and its engines may hold different ones (the operator's Secret has
    an admin token for the engines and a router-admin token for the routers): `admin_token` for
    the engine's own endpoints (/v1/loads), `router_token` for the probe's requests to `url`
    (a pin is an admin call of the router)."""
    auth = authorization_header(admin_token)
    headers = {PIN_HEADER: pin} if pin else {}
    headers.update(authorization_header(router_token if url != engine_url else admin_token))
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(settings.request_timeout_s, connect=5.0), headers=auth
    ) as client:
        if max_model_len is None:
            models = (await client.get(engine_url + Paths.MODELS)).json()
            max_model_len = int(models["data"][0]["max_model_len"])
        target = context_target(settings.shape, max_model_len)
        free_before, total = await kv_pages(client, engine_url, settings.settle_s)
        tally = _Tally()
        stop_watch = asyncio.Event()
        wedged: list = []
        watcher = asyncio.create_task(watch_engine(engine_url, role, settings, stop_watch, wedged, auth))
        started = time.monotonic()
        end = started + settings.duration_s

        async def conversations(worker: int) -> None:
            n = 0
            while time.monotonic() < end:
                seed = settings.seed * 1_000_003 + worker + n * settings.concurrency
                n += 1
                for prompt in rounds(settings.shape, max_model_len, seed):
                    if time.monotonic() >= end:
                        return
                    tally.requests += 1
                    try:
                        ok = await asyncio.wait_for(
                            _one(client, url, headers, prompt, settings.shape.answer_tokens, tally),
                            settings.request_timeout_s,
                        )
                    except asyncio.TimeoutError:
                        tally.stalled += 1
                        return  # a stalled conversation goes no further
                    except (httpx.HTTPError, ValueError) as e:
                        if isinstance(e, httpx.TimeoutException):
                            tally.stalled += 1
                        else:
                            tally.error(f"{type(e).__name__}: {e}"[:200])
                        return
                    if not ok:
                        return

        try:
            await asyncio.gather(*(conversations(i) for i in range(settings.concurrency)))
        finally:
            duration = time.monotonic() - started
            stop_watch.set()
            await watcher
        free_after, _ = await kv_pages(client, engine_url, settings.settle_s)
    figures = ProbeFigures(
        requests=tally.requests,
        errors=tally.errors,
        stalled=tally.stalled,
        ttft_p99_s=percentile(tally.ttfts, 99),
        itl_p99_s=percentile(tally.gaps, 99),
        prompt_tokens=tally.prompt_tokens,
        completion_tokens=tally.completion_tokens,
        max_context=tally.max_context,
        context_target=target,
        duration_s=round(duration, 3),
        first_error=tally.first_error,
    )
    return figures, WatchdogSignals(wedged[0] if wedged else None, free_before, free_after, total)
