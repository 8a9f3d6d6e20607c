"""What prefill and decode share: per-request PD state with deadlines, fault injection, and the
worker that makes outbound HTTP calls so the engine thread never blocks on the network."""

from __future__ import annotations

import enum
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import httpx

from dsv4_wire import authorization_header

log = logging.getLogger("dsv4.pd")

BOOT_ID = uuid.uuid4().hex[:12]  # one per process: a restarted peer is a different peer
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_MISSES = 5  # this many intervals without an answer and the peer is declared dead (3 was too tight on busy 2-core machines)


class PDState(enum.Enum):
    BOOTSTRAPPING = "Bootstrapping"
    WAITING_FOR_INPUT = "WaitingForInput"
    TRANSFERRING = "Transferring"
    SUCCESS = "Success"
    FAILED = "Failed"


@dataclass(eq=False)
class PDRequestInfo:
    """Where the request's peer is and how far the hand-off got. Every state has a deadline."""

    bootstrap_host: str
    bootstrap_port: int
    room: int
    state: PDState = PDState.BOOTSTRAPPING
    deadline: Optional[float] = None
    entered: float = field(default_factory=time.monotonic)
    peer: Optional[str] = None  # NIXL agent name of the other side
    peer_boot: Optional[str] = None
    peer_url: Optional[str] = None  # where to send an abort for this room
    dst_pages: list[int] = field(default_factory=list)
    handle: Optional[int] = None  # prefill: the NIXL transfer
    stalled: bool = False  # fault injection: a transfer that never completes nor fails
    transfer_started: Optional[float] = None

    @property
    def bootstrap_addr(self) -> str:
        return f"http://{self.bootstrap_host}:{self.bootstrap_port}"

    def enter(self, state: PDState, timeout: Optional[float]) -> None:
        self.state = state
        self.entered = time.monotonic()
        self.deadline = None if timeout is None else self.entered + timeout

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline


def fail_request(engine, seq, code: int, msg: str, counter: Optional[str] = None) -> None:
    """End a PD request with an error the client can read; `counter` is the metric it moves."""
    if counter:
        engine.metrics.inc(counter)
    seq.pd.state = PDState.FAILED
    log.warning("request %s room %s failed: %s", seq.rid, seq.pd.room, msg)
    engine.finish(seq, "error", error=msg, error_code=code)


class PDController:
    """What the prefill and decode controllers share: their NIXL agent, outbound HTTP, the
    deadline switch and how a request fails."""

    def __init__(self, engine, args, faults: "FaultInjector", role: str):
        from dsv4_engine.pd.nixl.agent import KVTransferAgent

        self.engine = engine
        self.args = args
        self.faults = faults
        self.deadlines = args.deadlines
        self.agent = KVTransferAgent(f"{role}-{BOOT_ID}", engine.pool.tensor, default_timeout_s=None)
        self.out = Outbound(engine.call, headers=authorization_header(getattr(args, "pd_secret", None)))

    def _timeout(self, seconds: float) -> Optional[float]:
        return seconds if self.deadlines and not self.faults.active("disable_deadlines") else None

    def _fail(self, seq, code: int, msg: str, counter: Optional[str] = None) -> None:
        fail_request(self.engine, seq, code, msg, counter)

    def close(self) -> None:
        self.out.close()
        self.agent.close()


FAULTS = ("stall_transfer", "fail_transfer", "drop_notification", "delay_bootstrap", "crash", "disable_deadlines")


class FaultInjector:
    """Faults armed over /admin/faults: each affects `count` requests (-1: until cleared)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: dict[str, dict[str, Any]] = {}

    def arm(self, name: str, count: int, **params: Any) -> None:
        if name not in FAULTS:
            raise ValueError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
        if count == 0 or count < -1:
            raise ValueError("count must be a positive number of requests or -1 (until cleared)")
        with self._lock:
            self._armed[name] = {"count": count, **params}

    def clear(self) -> None:
        with self._lock:
            self._armed.clear()

    def active(self, name: str) -> bool:
        with self._lock:
            return name in self._armed

    def take(self, name: str) -> Optional[dict[str, Any]]:
        """Consume one use of a fault; its parameters, or None when it is not armed."""
        with self._lock:
            f = self._armed.get(name)
            if f is None:
                return None
            if f["count"] > 0:
                f["count"] -= 1
                if f["count"] == 0:
                    del self._armed[name]
            return dict(f)

    def snapshot(self) -> dict:
        with self._lock:
            return {k: dict(v) for k, v in self._armed.items()}


class Outbound:
    """Outbound HTTP on worker threads; each result is handed back on the engine thread via
    `deliver` (Engine.call), so controllers never touch their state from two threads."""

    def __init__(self, deliver: Callable[[Callable[[], None]], None], timeout: float = 3.0,
                 headers: Optional[dict[str, str]] = None):
        self._deliver = deliver
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="dsv4-pd-http")
        self._client = httpx.Client(timeout=timeout, headers=headers or {})

    def post(self, url: str, body: dict, done: Optional[Callable[[Optional[dict], Optional[str]], None]] = None) -> None:
        self._pool.submit(self._call, "POST", url, body, done)

    def get(self, url: str, done: Optional[Callable[[Optional[dict], Optional[str]], None]] = None) -> None:
        self._pool.submit(self._call, "GET", url, None, done)

    def _call(self, method: str, url: str, body: Optional[dict], done) -> None:
        result, error = None, None
        try:
            r = self._client.request(method, url, json=body)
            if r.status_code >= 400:
                error = f"{method} {url} -> {r.status_code}: {r.text[:200]}"
            else:
                result = r.json()
        except Exception as e:  # unreachable peer, timeout, bad JSON: all the same to the caller
            error = f"{method} {url} failed: {type(e).__name__}: {e}"
        if done is not None:
            self._deliver(lambda: done(result, error))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()
