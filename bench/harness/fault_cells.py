"""The fault matrix's second set of cells (issue 45; bench/harness/fault_matrix.py runs and
judges them): the only router killed, `dsv4 up` itself killed, a lost PD notification, clients
leaving mid-stream, a full KV pool and an overloaded tokenizer.

Each function runs one cell on a running Cluster (or, for `up_sigkill`, its own `dsv4 up`) and
writes what it saw into the Cell; the caller then checks that every surviving engine is idle
with every page back.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import httpx

from bench.harness.migration_chaos import Cluster, LocalUp, body_for, streams, wait_idle

if TYPE_CHECKING:
    from bench.harness.fault_matrix import Cell

ROUTER_GONE_END_S = 5.0  # open streams must end this soon after the only router dies
UP_CHILDREN_GONE_S = 30.0  # `dsv4 up`'s children drain and exit within this after it is killed
POOL_REQUESTS = 24  # prompts of POOL_PROMPT tokens: about 2.7x one engine's 8192-token pool
POOL_PROMPT = 900
CHURN_LEAVERS = 12
CHAT_FLOOD = 48  # long chat requests at once, while the plain streams run
# Words per flood message: ~37 KB, ~29k tokens, past the tiny model's 2,048-token context but
# under what the engine's character pre-check refuses unread: the HTTP process renders and
# tokenizes each (~0.2 s) before it can refuse it (400), work for the tokenizer alone while the
# core stays idle (SGLang #33858's overload).
CHAT_WORDS = 7_500
GAP_SLACK_S = 2.0  # a plain stream's longest gap may grow by this under the flood, no more


def _judge(cell: "Cell", got: list, want: list) -> None:
    from bench.harness.fault_matrix import _judge_streams

    _judge_streams(cell, got, want)


# -- the only router killed and restarted --------------------------------------------------------


def router_sigkill(c: Cluster, cell: "Cell", want: list, b: list[dict]) -> None:
    """No healthy peer can exist: the promise is that open streams end at once (an error, never
    a hang), the engines free every page, and once the router is back the clients' retries get
    whole answers. Errors of streams open at the kill are counted in `dropped`, not as failures."""
    from bench.harness.fault_matrix import _busy_engine, _disturbed

    killed: dict = {}
    done = threading.Event()

    def fault() -> None:
        _busy_engine(c, cell.mode, done)
        killed["at"] = time.monotonic()
        os.kill(c.router.popen.pid, signal.SIGKILL)

    got, _ = _disturbed(c, b, fault, done)
    ended = time.monotonic() - killed["at"]
    if ended > ROUTER_GONE_END_S:
        cell.why.append(f"open streams took {ended:.1f}s to end after the router died")
    hung = [g for g in got if g.error == "hang"]
    if hung:
        cell.why.append(f"{len(hung)} streams hung")
    wait_idle(c.engine_urls(), timeout=40)  # the engines saw their clients go: every page back
    c.start_router()
    retried = [i for i, g in enumerate(got) if not g.ok]
    cell.dropped = len(retried)
    again = streams(c.r_url, [b[i] for i in retried], deadline_s=90)
    for i, g in zip(retried, again):
        got[i] = g
    _judge(cell, got, want)


# -- `dsv4 up` killed with kill -9 and started again -----------------------------------------------


def _descendants(pid: int) -> set[int]:
    """Every process under `pid` (from /proc), the process itself excluded."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def up_sigkill(model: Path, tmp: Path, cell: "Cell") -> None:
    """`dsv4 up` (one prefill, two decodes) killed with kill -9 while streams run: there is no
    peer, so its clients' streams end; none of its processes (router, engines, their cores)
    outlives it; `dsv4 up` started again on the same port comes back and answers whole."""
    b = [body_for(i, 320) for i in range(8)]  # long enough that the kill lands mid-stream
    for d in ("up1", "up2"):
        (tmp / d).mkdir(parents=True, exist_ok=True)
    up = LocalUp(model, tmp / "up1", "--decode", "2", "--no-watchdog")
    kids: set[int] = set()
    try:
        want = streams(up.url, b, deadline_s=90)
        if not all(w.ok for w in want):
            raise RuntimeError(f"the undisturbed run failed: {[w.error for w in want if not w.ok][:3]}")
        kids = _descendants(up.proc.popen.pid)
        box: dict = {}
        t = threading.Thread(target=lambda: box.update(out=streams(up.url, b, deadline_s=60)))
        t.start()
        deadline = time.monotonic() + 30
        while not any(_running(up.engine_url(k), up.admin) for k in ("decode-0", "decode-1")):
            if time.monotonic() > deadline or not t.is_alive():
                break
            time.sleep(0.02)
        os.kill(up.proc.popen.pid, signal.SIGKILL)
        killed = time.monotonic()
        t.join(90)
        if time.monotonic() - killed > ROUTER_GONE_END_S:
            cell.why.append(f"open streams took {time.monotonic() - killed:.1f}s to end after dsv4 up died")
        cell.dropped = sum(1 for g in box.get("out", []) if not g.ok)
        if not cell.dropped:
            cell.why.append("every stream had finished before the kill: nothing was tried")
        if any(g.error == "hang" for g in box.get("out", [])):
            cell.why.append("a stream hung after dsv4 up died")
        deadline = time.monotonic() + UP_CHILDREN_GONE_S
        while _alive(kids) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _alive(kids):
            cell.why.append(f"{len(_alive(kids))} of its {len(kids)} processes outlived dsv4 up")
            return
        up.stop()
        again = LocalUp(model, tmp / "up2", "--decode", "2", "--no-watchdog", port=up.port)
        try:
            _judge(cell, streams(again.url, b, deadline_s=90), want)
            engines = [again.engine_url(k) for k in again.processes() if k != "router"]
            wait_idle(engines, timeout=40, headers=again.admin)
        finally:
            again.stop()
    finally:
        up.stop()
        for pid in _alive(kids):  # a failed cell must not leave them to the next one
            os.kill(pid, signal.SIGKILL)


def _running(url: str, headers: dict) -> bool:
    try:
        return httpx.get(url + "/v1/loads", timeout=2, headers=headers).json()["queues"].get("running", 0) > 0
    except (httpx.HTTPError, ValueError, KeyError):
        return False


# -- clients leaving mid-stream ----------------------------------------------------------------


async def _leave_after(session: aiohttp.ClientSession, url: str, body: dict, events: int) -> int:
    """Read `events` SSE events of a stream, then close the connection: a client that left."""
    seen = 0
    async with session.post(url + "/v1/completions", json=body) as r:
        async for _line in r.content:
            if _line.startswith(b"data: "):
                seen += 1
                if seen >= events:
                    break
    return seen


def client_churn(c: Cluster, cell: "Cell", want: list, b: list[dict], seed: int = 45) -> None:
    """The undisturbed streams run beside CHURN_LEAVERS clients that leave after a random number
    of events: the stayers are whole, and once the leavers are gone every page is back."""
    rng = random.Random(seed)
    leavers = [(body_for(100 + i, 200), rng.randrange(1, 60)) for i in range(CHURN_LEAVERS)]

    async def go() -> list:
        conn = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:
            return await asyncio.gather(*(_leave_after(s, c.r_url, body, n) for body, n in leavers))

    box: dict = {}
    t = threading.Thread(target=lambda: box.update(left=asyncio.run(go())))
    t.start()
    got = streams(c.r_url, b, deadline_s=90)
    t.join(90)
    if "left" not in box:
        cell.why.append("the leaving clients did not run")
    _judge(cell, got, want)


# -- a full KV pool --------------------------------------------------------------------------------


def _pool_bodies() -> list[dict]:
    return [
        {**body_for(i, 24), "prompt": [(11 * i + 5 * j) % 400 + 3 for j in range(POOL_PROMPT + i)]}
        for i in range(POOL_REQUESTS)
    ]


def kv_pool_full(c: Cluster, cell: "Cell") -> None:
    """More prompts at once than every pool holds: they wait for pages (or are refused 429/503
    with Retry-After), none hangs, each answer equals the one it gets alone in a small batch."""
    b = _pool_bodies()
    want: list = []
    for i in range(0, len(b), 4):  # 4 at a time fit in any one pool: the undisturbed answers
        want += streams(c.r_url, b[i : i + 4], deadline_s=120)
    if not all(w.ok for w in want):
        raise RuntimeError(f"the small batches failed: {[w.error for w in want if not w.ok][:3]}")
    low: dict = {}
    over = threading.Event()

    def watch() -> None:  # the least free share of any engine's pool while they run
        while not over.is_set():
            for u in c.engine_urls():
                try:
                    ld = httpx.get(u + "/v1/loads", timeout=2).json()
                    low[u] = min(low.get(u, 1.0), ld["kv_pages_free"] / ld["kv_pages_total"])
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
            time.sleep(0.05)

    w = threading.Thread(target=watch)
    w.start()
    try:
        got = streams(c.r_url, b, deadline_s=120)
    finally:
        over.set()
        w.join(10)
    if min(low.values(), default=1.0) > 0.1:
        cell.why.append(f"no pool came near full (least free share {min(low.values(), default=1.0):.2f})")
    refused = [g for g in got if g.error and g.error.startswith(("http 429", "http 503"))]
    cell.refused_429 = len(refused)
    ok = [(g, w) for g, w in zip(got, want) if g not in refused]
    _judge(cell, [g for g, _ in ok], [w for _, w in ok])


# -- the tokenizer / HTTP process overloaded ---------------------------------------------------------


def _flood_body(i: int) -> dict:
    words = " ".join(f"w{(i * 31 + j) % 997}" for j in range(CHAT_WORDS))
    return {"model": "m", "messages": [{"role": "user", "content": words}], "max_tokens": 4, "temperature": 0}


def tokenizer_overload(c: Cluster, cell: "Cell", want: list, b: list[dict]) -> None:
    """CHAT_FLOOD long chat requests arrive at once while the plain streams run: the plain
    streams stay whole and their longest gap grows by at most GAP_SLACK_S (no starved event
    loop); each chat request gets its answer (400: past the context) or a 429 with
    Retry-After, none hangs."""
    results: list = []
    first = threading.Event()  # one flood answer came back: the rest are queued for the tokenizer

    async def flood() -> None:
        async with httpx.AsyncClient(timeout=90) as client:

            async def one(i: int) -> None:
                try:
                    r = await client.post(c.r_url + "/v1/chat/completions", json=_flood_body(i))
                    results.append((r.status_code, r.headers.get("retry-after"), time.monotonic()))
                except httpx.HTTPError as e:
                    results.append((type(e).__name__, None, time.monotonic()))
                first.set()

            await asyncio.gather(*(one(i) for i in range(CHAT_FLOOD)))

    t = threading.Thread(target=lambda: asyncio.run(flood()))
    t.start()
    first.wait(60)
    began = time.monotonic()
    got = streams(c.r_url, b, deadline_s=90)
    t.join(120)
    if not results or max(r[2] for r in results) < began + 0.3:  # else the streams met a busy tokenizer
        cell.why.append("the flood was over before the streams began: nothing was tried")
    _judge(cell, got, want)
    worst, base = max(g.max_gap for g in got), max(w.max_gap for w in want)
    cell.gap_s = round(worst, 2)
    if worst > base + GAP_SLACK_S:
        cell.why.append(f"a plain stream waited {worst:.2f}s between events (undisturbed: {base:.2f}s)")
    cell.refused_429 = sum(1 for s, _, _ in results if s == 429)
    bad = [s for s, ra, _ in results if s not in (200, 400, 429) or (s == 429 and not (ra or "").isdigit())]
    if len(results) != CHAT_FLOOD or bad:
        cell.client_errors += len(bad) + CHAT_FLOOD - len(results)
        cell.why.append(f"flood answers: {json.dumps(bad[:5])} ({len(results)} of {CHAT_FLOOD} returned)")


# -- a planned roll of the only prefill and the only decode ------------------------------------------


def planned_roll(model: Path, tmp: Path, cell: "Cell") -> None:
    """`dsv4 up` with one prefill and one decode while `dsv4 up --reconfigure` canaries and rolls
    both (a harmless flag, kept): a planned change of a role with one engine costs latency, not
    errors (surge: the new engine is routed to before the old one drains). Rounds of streams run
    back to back for the whole reconfigure; each must equal the undisturbed round."""
    import subprocess
    import sys

    b = [body_for(i, 48) for i in range(6)]
    (tmp / "up").mkdir(parents=True, exist_ok=True)
    up = LocalUp(model, tmp / "up", "--no-watchdog")
    try:
        want = streams(up.url, b, deadline_s=90)
        if not all(w.ok for w in want):
            raise RuntimeError(f"the undisturbed run failed: {[w.error for w in want if not w.ok][:3]}")
        before = {k: p["port"] for k, p in up.processes().items()}
        out: dict = {}

        def reconfigure() -> None:
            out["done"] = subprocess.run(
                [sys.executable, "-m", "dsv4_cli", "up", "--port", str(up.port), "--reconfigure"]
                + ["--probe-duration", "3", "--probe-concurrency", "1", "--engine-arg=--kv-pages=512"]
                + ["--engine-arg=--page-size=16", "--engine-arg=--max-num-seqs=32"],
                capture_output=True,
                text=True,
                timeout=400,
                env={**os.environ, "DSV4_CACHE": str(tmp / "up" / "cache")},
            )

        t = threading.Thread(target=reconfigure)
        t.start()
        got: list = []
        while t.is_alive() or not got:
            got += streams(up.url, b, deadline_s=120)
        t.join()
        _judge(cell, got, want * (len(got) // len(b)))
        done = out["done"]
        result = json.loads(done.stdout or "{}")
        if done.returncode != 0 or not result.get("kept"):
            cell.why.append(f"the harmless change was not kept: {done.stdout[-300:]} {done.stderr[-300:]}")
        after = {k: p["port"] for k, p in up.processes().items()}
        if any(after.get(k) == before[k] for k in ("prefill-0", "decode-0")):
            cell.why.append(f"an engine was not replaced by a surge: {before} -> {after}")
        wait_idle([up.engine_url(k) for k in ("prefill-0", "decode-0")], timeout=40, headers=up.admin)
    finally:
        up.stop()
