"""The fault matrix (issue 45): faults x modes, each cell stating its expected outcome before it
runs, on real processes (bench/harness/migration_chaos.py's Cluster: a router and its engines on
127.0.0.1, the tiny model).

Modes: `mono` (two mono engines), `pd` (one prefill, two decodes), `pd_structured` (the PD
cluster, json_schema streams mixed in: a moved structured stream rebuilds its grammar state).
Every engine runs with --enable-fault-injection, --transfer-checksum and --max-queued-requests.

Faults: the decode (mono: an engine) killed or frozen mid-stream; a KV transfer that fails, or
whose bytes are corrupted in flight (PD only); a burst past the queue bound. Where a healthy
peer exists the promise is 0 client errors and every stream equal to the undisturbed run; a
corruption must be noticed (the checksum counter); a burst gets 429s with Retry-After and
nothing else, and no PD state is left behind. After every cell every surviving engine is idle
with every KV page back.

`run_matrix(model, tmp, modes, faults)` -> the cells' records (pure data: JSON).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import httpx

from bench.harness import fault_cells as cells
from bench.harness.migration_chaos import Cluster, body_for, mismatches, streams, wait_idle

STREAMS = 12
TOKENS = 96
SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 900}, "kind": {"enum": ["a", "bb", "ccc"]}},
    "required": ["id", "kind"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
ENGINE_ARGS = ["--enable-fault-injection", "--transfer-checksum", "--max-queued-requests", 2 * STREAMS]
MODES = ("mono", "pd", "pd_structured")
FAULTS = (
    "decode_sigkill",
    "decode_sigstop",
    "transfer_fails",
    "transfer_corrupted",
    "notification_lost",
    "queue_burst",
    "client_churn",
    "kv_pool_full",
    "tokenizer_overload",
    "router_sigkill",
    "up_sigkill",
    "planned_roll",
)
EXPECT = {
    "decode_sigkill": "0 client errors; every stream equal to the undisturbed run (migrated)",
    "decode_sigstop": "0 client errors; every stream equal to the undisturbed run; moved within 25 s",
    "transfer_fails": "0 client errors; every stream equal to the undisturbed run (re-sent)",
    "transfer_corrupted": "0 client errors; every stream equal to the undisturbed run; the corruption noticed",
    "notification_lost": "0 client errors; every stream equal to the undisturbed run (decode's deadline, re-sent)",
    "queue_burst": "only 429s with Retry-After beyond the bound, the rest whole; no PD state left",
    "client_churn": "clients leaving mid-stream cost the others nothing; every page back once they left",
    "kv_pool_full": "requests past the pool wait (or 429/503 with Retry-After), none hangs; every answer whole",
    "tokenizer_overload": "48 long chats at once: plain streams whole, longest gap +2 s at most; chats 200 or 429",
    "router_sigkill": "no peer: open streams end within 5 s, never hang; engines free every page; retries whole",
    "up_sigkill": "no peer: none of its processes outlives it; restarted on its port it answers whole",
    "planned_roll": "dsv4 up --reconfigure rolls the only prefill and decode: 0 client errors, every round whole",
}
PD_ONLY = ("transfer_fails", "transfer_corrupted", "notification_lost")
ONE_MODE = {"up_sigkill": "pd", "planned_roll": "pd"}  # its own `dsv4 up`, not the mode's cluster: run once
# Decode's wait for a hand-off's KV keeps its default (60 s): it is what catches a lost
# notification, but it also runs while prefill queues for pages, so a short one (6 s was tried)
# turned the full-pool cell's waits into client errors (504, then the router's 502).
DECODE_ARGS: list = []


@dataclass
class Cell:
    fault: str
    mode: str
    expect: str
    applicable: bool = True
    passed: Optional[bool] = None
    client_errors: int = 0
    wrong_answers: int = 0
    refused_429: int = 0
    seconds: float = 0.0
    noticed: Optional[float] = None  # corruptions the checksum caught
    dropped: int = 0  # no peer (router or `dsv4 up` killed): streams that ended with the process
    gap_s: Optional[float] = None  # tokenizer_overload: the longest gap of a plain stream
    why: list[str] = field(default_factory=list)


def bodies(mode: str) -> list[dict]:
    out = []
    for i in range(STREAMS):
        if mode == "pd_structured" and i % 3 == 0:
            out.append(body_for(i, 96, ignore_eos=False, response_format=FORMAT))
        else:
            out.append(body_for(i, TOKENS))
    return out


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + "{"))


def _checksum_failures(c: Cluster) -> float:
    return sum(_metric(c.urls[d], "dsv4:kv_transfer_checksum_failed_total") for d in ("decode0", "decode1"))


def _arm(url: str, fault: str, count: int = 1) -> None:
    r = httpx.post(url + "/admin/faults", json={"fault": fault, "count": count}, timeout=5)
    r.raise_for_status()


def _healthy(c: Cluster, name: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = httpx.get(c.r_url + "/admin/workers", timeout=5).json()["workers"]
        if any(w["url"] == c.urls[name] and w["healthy"] for w in workers):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{name} did not come back into rotation")


def _disturbed(
    c: Cluster, b: list[dict], fault: Callable[[], None], done: Optional[threading.Event] = None
) -> tuple[list, float]:
    """Run the streams, with `fault` applied meanwhile; `done` is set once they all returned."""
    box: dict = {}
    done = done or threading.Event()
    t0 = time.monotonic()

    def run() -> None:
        try:
            box["out"] = streams(c.r_url, b, deadline_s=90)
        finally:
            done.set()

    t = threading.Thread(target=run)
    t.start()
    try:
        fault()
    finally:
        t.join(120)
    return box.get("out", []), time.monotonic() - t0


def _judge_streams(cell: Cell, got: list, want: list) -> None:
    if len(got) != len(want):
        cell.why.append(f"{len(want) - len(got)} clients never returned")
    bad = mismatches(got, want, None)
    cell.client_errors = sum(1 for g in got if not g.ok)
    cell.wrong_answers = sum(
        1 for i, g in enumerate(got) if g.ok and any(line.startswith(f"stream {i}:") for line in bad)
    )
    cell.why += bad[:3]


def _busy_engine(c: Cluster, mode: str, done: threading.Event, timeout: float = 30.0) -> str:
    """The first of the two serving engines seen running a request: the victim. Not a fixed
    one: the router may place every short stream of a run on one engine, and on the tiny model
    a run is over in half a second."""
    names = ("mono0", "mono1") if mode == "mono" else ("decode0", "decode1")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not done.is_set():
        for name in names:
            if c.running(name) >= 1:
                return name
        time.sleep(0.02)
    raise TimeoutError(f"no engine of {names} was seen running a request\n{c.logs()}")


def run_cell(c: Cluster, cell: Cell, want: list, tmp: Optional[Path] = None) -> None:
    b = bodies(cell.mode)
    t0 = time.monotonic()
    if cell.fault == "router_sigkill":
        cells.router_sigkill(c, cell, want, b)
    elif cell.fault == "up_sigkill":
        cells.up_sigkill(c.model, tmp or c.tmp, cell)
    elif cell.fault == "planned_roll":
        cells.planned_roll(c.model, tmp or c.tmp, cell)
    elif cell.fault == "client_churn":
        cells.client_churn(c, cell, want, b)
    elif cell.fault == "kv_pool_full":
        cells.kv_pool_full(c, cell)
    elif cell.fault == "tokenizer_overload":
        cells.tokenizer_overload(c, cell, want, b)
    elif cell.fault in ("decode_sigkill", "decode_sigstop"):
        hit: dict = {}
        done = threading.Event()

        def fault() -> None:
            hit["name"] = victim = _busy_engine(c, cell.mode, done)
            if cell.fault == "decode_sigkill":
                c.kill(victim)
            else:
                hit["pgid"] = c.procs[victim].popen.pid
                os.killpg(hit["pgid"], signal.SIGSTOP)

        try:
            got, took = _disturbed(c, b, fault, done)
        finally:
            if "pgid" in hit:
                os.killpg(hit["pgid"], signal.SIGCONT)
        _judge_streams(cell, got, want)
        if cell.fault == "decode_sigstop" and took > 25:
            cell.why.append(f"took {took:.1f}s")
        if cell.fault == "decode_sigkill":
            c.restart(hit["name"])
        _healthy(c, hit["name"])
    elif cell.fault in PD_ONLY:
        name = {"transfer_fails": "fail_transfer", "transfer_corrupted": "corrupt_transfer"}.get(
            cell.fault, "drop_notification"
        )
        caught = _checksum_failures(c)
        # Armed before the streams start: the tiny model can prefill and send all of them before
        # an arm sent alongside reaches the core, and the fault would land on the next cell.
        _arm(c.urls["prefill"], name, 2)
        got, _ = _disturbed(c, b, lambda: None)
        _judge_streams(cell, got, want)
        if cell.fault == "transfer_corrupted":
            cell.noticed = _checksum_failures(c) - caught
            if not cell.noticed:
                cell.why.append("no corruption was noticed")
    elif cell.fault == "queue_burst":
        ok, retry_after, other = asyncio.run(_burst(c.r_url, 160))
        cell.refused_429, cell.client_errors = len(retry_after), len(other)
        cell.why += other[:3]
        if any(not r.isdigit() for r in retry_after):
            cell.why.append(f"429 without Retry-After: {retry_after[:3]}")
    cell.seconds = round(time.monotonic() - t0, 2)
    try:
        wait_idle(list(c.urls.values()), timeout=40)
    except TimeoutError as e:
        cell.why.append(f"left state behind: {str(e)[:300]}")
    cell.passed = cell.client_errors == 0 and cell.wrong_answers == 0 and not cell.why


async def _burst(url: str, n: int) -> tuple[int, list[str], list[str]]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=90)
    ok, retry_after, other = 0, [], []

    async def one(i: int) -> None:
        nonlocal ok
        try:
            await client.completions.create(
                model="m", prompt=[(3 * i + j) % 300 + 3 for j in range(6)], max_tokens=8, temperature=0
            )
            ok += 1
        except openai.RateLimitError as e:
            retry_after.append(e.response.headers.get("retry-after", ""))
        except Exception as e:  # any other error fails the cell
            other.append(f"{type(e).__name__}: {e}"[:200])

    try:
        await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await client.close()
    return ok, retry_after, other


def run_matrix(model: Path, tmp: Path, modes=MODES, faults=FAULTS, log=print) -> list[dict]:
    cells: list[Cell] = []
    clusters = {"mono": "mono", "pd": "pd", "pd_structured": "pd"}
    for kind in dict.fromkeys(clusters[m] for m in modes):
        (tmp / kind).mkdir(parents=True, exist_ok=True)
        c = Cluster(
            model,
            tmp / kind,
            decodes=2,
            mono=kind == "mono",
            engine_args=ENGINE_ARGS,
            decode_args=[] if kind == "mono" else DECODE_ARGS,
        )
        try:
            for mode in [m for m in modes if clusters[m] == kind]:
                want = streams(c.r_url, bodies(mode))
                if not all(w.ok for w in want):
                    raise RuntimeError(f"the undisturbed run failed: {[w.error for w in want if not w.ok][:3]}")
                for fault in faults:
                    applicable = not (mode == "mono" and fault in PD_ONLY) and ONE_MODE.get(fault, mode) == mode
                    cell = Cell(fault, mode, EXPECT[fault], applicable=applicable)
                    log(f"[{mode} x {fault}] expect: {cell.expect}")
                    if cell.applicable:
                        try:
                            run_cell(c, cell, want, tmp / kind / f"{mode}-{fault}")
                        except Exception as e:  # the cell could not run as planned: a failed cell, said
                            cell.passed = False
                            cell.why.append(f"{type(e).__name__}: {str(e)[:300]}")
                        log(f"  -> {'PASS' if cell.passed else 'FAIL'} in {cell.seconds}s {cell.why[:2]}")
                    cells.append(cell)
        finally:
            c.stop()
    return [asdict(x) for x in cells]
