"""Real-process PD load with hostile clients, shared by the chaos tests and bench/experiments/router_load.py.

A `PDStack` is a prefill engine, a decode engine and a router, each a real `dsv4` process on
127.0.0.1. `storm` sends many concurrent streaming completions through the router; some
clients hang up after a few events or after a random delay (possibly while still queued).
Every request ends in exactly one `Outcome`, and every wait is bounded by a deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import aiohttp
import httpx

from bench.harness.commands import Proc, free_port, stop_all  # noqa: E402

# ---- one request -----------------------------------------------------------------------------


@dataclass
class Outcome:
    """How one client's request ended.

    kind: ok (a full stream ending in [DONE]) | left (the client hung up itself) | http (a non-200
    status, in `status`) | sse_error (an error event inside a 200 stream) | truncated (the stream
    ended without [DONE] or error) | conn_error (no HTTP answer at all) | hang (no end within the
    client's deadline)."""

    kind: str
    status: int = 0
    elapsed: float = 0.0
    events: int = 0
    detail: str = ""
    retry_after: Optional[str] = None
    openai_error: bool = True  # an error body/event had the {"error": {"message", "type", ...}} shape


def _is_openai_error(obj) -> bool:
    err = obj.get("error") if isinstance(obj, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and "type" in err and "code" in err


async def stream_one(
    session: aiohttp.ClientSession,
    url: str,
    prompt: list[int],
    max_tokens: int,
    *,
    leave_after_events: Optional[int] = None,
    leave_after_s: Optional[float] = None,
    deadline_s: float = 60.0,
) -> Outcome:
    t0 = time.monotonic()
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}

    async def run() -> Outcome:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            if r.status != 200:
                text = await r.text()
                try:
                    shaped = _is_openai_error(json.loads(text))
                except ValueError:
                    shaped = False
                return Outcome(
                    "http", r.status, detail=text[:300], retry_after=r.headers.get("Retry-After"), openai_error=shaped
                )
            events, buf = 0, b""
            async for chunk in r.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if not event.startswith(b"data: "):
                        continue
                    data = event[6:]
                    if data == b"[DONE]":
                        return Outcome("ok", 200, events=events)
                    try:
                        obj = json.loads(data)
                    except ValueError:
                        return Outcome("truncated", 200, events=events, detail=f"bad event {data[:100]!r}")
                    if "error" in obj:
                        return Outcome(
                            "sse_error", 200, events=events, detail=str(obj)[:300], openai_error=_is_openai_error(obj)
                        )
                    events += 1
                    if leave_after_events is not None and events >= leave_after_events:
                        r.close()  # hang up mid-stream: drop the connection
                        return Outcome("left", 200, events=events)
            return Outcome("truncated", 200, events=events, detail="stream ended without [DONE]")

    task = asyncio.ensure_future(run())
    limit = deadline_s if leave_after_s is None else min(deadline_s, leave_after_s)
    try:
        done, _ = await asyncio.wait({task}, timeout=limit)
        if done:
            out = task.result()
        else:
            task.cancel()
            with _suppress():
                await task
            out = Outcome("left" if leave_after_s is not None and limit < deadline_s else "hang", detail="timer")
    except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
        out = Outcome("conn_error", detail=f"{type(e).__name__}: {e}"[:300])
    out.elapsed = time.monotonic() - t0
    return out


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], (asyncio.CancelledError, Exception))


# ---- many requests ---------------------------------------------------------------------------


@dataclass
class StormSpec:
    requests: int = 200
    max_tokens: int = 8
    leave_mid_stream: float = 0.15  # share of clients that hang up after a few events
    leave_on_timer: float = 0.05  # share that hang up after a random delay (maybe still queued)
    prompt_len: tuple[int, int] = (4, 40)
    deadline_s: float = 60.0  # a client still waiting after this is a hang
    seed: int = 0


async def storm_async(url: str, spec: StormSpec) -> list[Outcome]:
    rng = random.Random(spec.seed)
    conn = aiohttp.TCPConnector(limit=0, force_close=True)  # one connection per request, no pool cap
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
        jobs = []
        for _ in range(spec.requests):
            prompt = [rng.randrange(2, 500) for _ in range(rng.randint(*spec.prompt_len))]
            roll = rng.random()
            kw: dict = {}
            if roll < spec.leave_mid_stream:
                kw["leave_after_events"] = rng.randint(1, max(1, spec.max_tokens - 1))
            elif roll < spec.leave_mid_stream + spec.leave_on_timer:
                kw["leave_after_s"] = rng.uniform(0.05, 2.0)
            jobs.append(stream_one(session, url, prompt, spec.max_tokens, deadline_s=spec.deadline_s, **kw))
        return list(await asyncio.gather(*jobs))


def storm(url: str, spec: StormSpec) -> list[Outcome]:
    return asyncio.run(storm_async(url, spec))


def tally(outcomes: list[Outcome]) -> dict:
    kinds = Counter(o.kind if o.kind != "http" else f"http_{o.status}" for o in outcomes)
    elapsed = sorted(o.elapsed for o in outcomes)
    return {
        "requests": len(outcomes),
        "outcomes": dict(sorted(kinds.items())),
        "p50_s": round(elapsed[len(elapsed) // 2], 2) if elapsed else None,
        "max_s": round(elapsed[-1], 2) if elapsed else None,
    }


def server_errors(outcomes: list[Outcome]) -> list[Outcome]:
    """What must never happen under load alone: 5xx, error events, cut streams, hangs."""
    return [
        o
        for o in outcomes
        if o.kind in ("sse_error", "truncated", "conn_error", "hang") or (o.kind == "http" and o.status >= 500)
    ]


# ---- the processes ---------------------------------------------------------------------------

ENGINE_ARGS = ["--kv-pages", 512, "--page-size", 16, "--max-num-seqs", 64, "--served-model-name", "m"]


class PDStack:
    """prefill + decode + router as real processes on 127.0.0.1.

    `router_cmd` replaces the router process's command (e.g. the router code of another commit);
    by default it is `dsv4 router` from this tree with `router_args`."""

    def __init__(
        self,
        model: Path,
        tmp: Path,
        *,
        router_args=(),
        engine_args=(),
        pd_secret: Optional[str] = None,
        router_python_path: Optional[str] = None,
        start_router: bool = True,
        health_interval: float = 0.5,
    ):
        self.model, self.tmp = Path(model), Path(tmp)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.p_port, self.b_port, self.d_port, self.r_port = (free_port() for _ in range(4))
        self.engine_args = [*ENGINE_ARGS, *engine_args]
        self.env = {"DSV4_PD_SECRET": pd_secret} if pd_secret else {}
        self.router_args = list(router_args)
        self.router_python_path = router_python_path
        self.health_interval = health_interval
        self.restarts = 0
        self.prefill = self._engine("prefill", ["--port", self.p_port, "--bootstrap-port", self.b_port])
        self.decode = self._engine("decode", ["--port", self.d_port])
        self.router: Optional[Proc] = None
        try:
            self.prefill.wait_ready(self.p_url, timeout=120)
            self.decode.wait_ready(self.d_url, timeout=120)
            if start_router:
                self.start_router()
        except BaseException:
            self.stop()
            raise

    def _engine(self, role: str, args: list) -> Proc:
        return Proc(
            ["serve", "--model", self.model, "--role", role, *self.engine_args, *args],
            self.tmp / f"{role}-{self.restarts}.log",
            env=self.env,
        )

    def start_router(self) -> None:
        self.router, url = self.another_router(self.router_args, port=self.r_port)

    def another_router(self, router_args, *, port: Optional[int] = None, name: str = "router") -> tuple[Proc, str]:
        """A router process on these engines (e.g. with other limits): (process, its URL)."""
        env = dict(self.env)
        if self.router_python_path:  # run another commit's router package instead of this tree's
            env["PYTHONPATH"] = self.router_python_path + os.pathsep + os.environ.get("PYTHONPATH", "")
        port = port or free_port()
        proc = Proc(
            [
                "router",
                "--prefill",
                self.p_url,
                "--decode",
                self.d_url,
                "--port",
                port,
                "--health-interval",
                self.health_interval,
                *router_args,
            ],
            self.tmp / f"{name}-{port}.log",
            env=env,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            proc.wait_ready(url, timeout=60)
        except BaseException:
            proc.stop()
            raise
        return proc, url

    p_url = property(lambda self: f"http://127.0.0.1:{self.p_port}")
    d_url = property(lambda self: f"http://127.0.0.1:{self.d_port}")
    r_url = property(lambda self: f"http://127.0.0.1:{self.r_port}")

    def kill_decode(self) -> None:
        """kill -9, no goodbye: streams are cut mid-flight."""
        os.kill(self.decode.popen.pid, signal.SIGKILL)
        self.decode.popen.wait(10)
        self.decode.stop()

    def restart_decode(self, timeout: float = 120) -> None:
        self.restarts += 1
        self.decode = self._engine("decode", ["--port", self.d_port])
        self.decode.wait_ready(self.d_url, timeout=timeout)

    def stop(self) -> None:
        stop_all([self.router, self.decode, self.prefill])

    def logs(self) -> str:
        return "\n".join(
            f"--- {name}\n{p.log()}"
            for name, p in (("router", self.router), ("decode", self.decode), ("prefill", self.prefill))
            if p is not None
        )


# ---- settling ----------------------------------------------------------------------------------


def loads(url: str) -> dict:
    return httpx.get(f"{url}/v1/loads", timeout=5).json()


def idle(ld: dict) -> bool:
    return sum(ld["queues"].values()) == 0 and ld["kv_pages_free"] == ld["kv_pages_total"]


def wait_engines_idle(*urls: str, timeout: float = 30.0) -> float:
    """Seconds until every engine's queues are empty and every KV page is free."""
    t0 = time.monotonic()
    last: dict = {}
    while time.monotonic() - t0 < timeout:
        try:
            last = {u: loads(u) for u in urls}
            if all(idle(ld) for ld in last.values()):
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"engines not idle after {timeout}s: {last}")


def fresh_request(url: str, timeout: float = 10.0) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        json={"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0, "ignore_eos": True},
        timeout=timeout,
    )


def wait_service(router_url: str, timeout: float = 30.0) -> float:
    """Seconds until the router says ready and a fresh request through it succeeds."""
    t0 = time.monotonic()
    last = ""
    while (left := timeout - (time.monotonic() - t0)) > 0:
        try:
            ready = httpx.get(f"{router_url}/ready", timeout=min(2.0, left))
            if ready.status_code == 200:
                r = fresh_request(router_url, timeout=max(0.5, timeout - (time.monotonic() - t0)))
                if r.status_code == 200:
                    return time.monotonic() - t0
                last = f"{r.status_code} {r.text[:200]}"
            else:
                last = f"router not ready: {ready.text[:200]}"
        except httpx.HTTPError as e:
            last = type(e).__name__
        time.sleep(0.1)
    raise TimeoutError(f"no service through {router_url} after {timeout}s: {last}")


def wait_router_idle(router_url: str, timeout: float = 10.0) -> float:
    """Seconds until the router holds no admission slot and queues nobody (no leaked slots)."""
    t0 = time.monotonic()
    last: dict = {}
    while time.monotonic() - t0 < timeout:
        last = httpx.get(f"{router_url}/ready", timeout=2).json()
        if last.get("inflight") == 0 and last.get("queued") == 0:
            return time.monotonic() - t0
        time.sleep(0.1)
    raise TimeoutError(f"router still holds requests after {timeout}s: {last}")


def kill_decode_mid_stream(
    stack: PDStack, *, requests: int, seed: int, recovery_s: float, max_tokens: int = 400
) -> tuple[dict, list[Outcome]]:
    """Streams running through the router, then kill -9 of the decode engine, then its restart.

    Returns the figures (how long until every client had its answer, the engine's restart,
    service through the router after the engine is ready again) and the clients' outcomes."""
    box: dict = {}
    spec = StormSpec(
        requests=requests,
        max_tokens=max_tokens,
        leave_mid_stream=0.0,
        leave_on_timer=0.0,
        seed=seed,
        prompt_len=(4, 12),
        deadline_s=60,
    )
    t = threading.Thread(target=lambda: box.update(out=storm(stack.r_url, spec)))
    t.start()
    deadline = time.monotonic() + 60
    while loads(stack.d_url)["queues"].get("running", 0) < min(requests, 8):  # streams are mid-flight
        if time.monotonic() > deadline or not t.is_alive():
            t.join(90)
            raise TimeoutError(f"streams never started\n{stack.logs()}")
        time.sleep(0.05)
    killed_at = time.monotonic()
    stack.kill_decode()
    t.join(90)
    if t.is_alive():
        raise TimeoutError(f"a client hangs after the decode engine was killed\n{stack.logs()}")
    told = time.monotonic() - killed_at
    t0 = time.monotonic()
    stack.restart_decode()
    engine_up = time.monotonic() - t0
    back = wait_service(stack.r_url, timeout=recovery_s)
    return (
        {
            "clients_told_s": round(told, 2),
            "decode_restart_s": round(engine_up, 2),
            "service_back_after_ready_s": round(back, 2),
            "outcomes": tally(box["out"])["outcomes"],
        },
        box["out"],
    )
