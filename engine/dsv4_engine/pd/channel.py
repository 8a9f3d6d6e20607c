"""The control messages PD engines send each other (register a room, abort it, heartbeat), as a
declared seam: `ControlChannel`. Production speaks HTTP to the peer's PD endpoints
(`dsv4_serve.pd_routes`) with the shared PD secret; tests link controllers in one process
(`dsv4_engine.pd.fake`).

Contract: a call never blocks the caller's thread, and `done(result, error)` runs later on the
caller's own thread (the engine loop, via the `deliver` function given at construction), exactly
once, with either the peer's JSON answer or a one-line error (unreachable, refused, timed out).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Protocol

import httpx

from dsv4_engine.pd.messages import AbortRoom, RegisterRoom
from dsv4_wire import Paths

Done = Callable[[Optional[dict], Optional[str]], None]
Deliver = Callable[[Callable[[], None]], None]


class ControlChannel(Protocol):
    def register(self, bootstrap_addr: str, msg: RegisterRoom, done: Done) -> None:
        """Decode -> prefill: these are the pages reserved for `msg.room`."""

    def heartbeat(self, bootstrap_addr: str, decode_boot: str, done: Done) -> None:
        """Decode -> prefill: are you alive, and still the same process (its boot id)?"""

    def abort_prefill(self, bootstrap_addr: str, room: int, reason: str) -> None:
        """Decode -> prefill: drop this room."""

    def abort_decode(self, decode_url: str, room: int, reason: str) -> None:
        """Prefill -> decode: this room failed here."""

    def close(self) -> None: ...


class HttpChannel:
    """ControlChannel over HTTP on worker threads; answers are handed back through `deliver`
    (Engine.call), so controllers never touch their state from two threads."""

    def __init__(self, deliver: Deliver, timeout: float = 3.0, headers: Optional[dict[str, str]] = None):
        self._deliver = deliver
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="dsv4-pd-http")
        self._client = httpx.Client(timeout=timeout, headers=headers or {})

    def register(self, bootstrap_addr: str, msg: RegisterRoom, done: Done) -> None:
        self._submit("POST", bootstrap_addr + Paths.BOOTSTRAP_REGISTER, msg.wire(), done)

    def heartbeat(self, bootstrap_addr: str, decode_boot: str, done: Done) -> None:
        self._submit("GET", f"{bootstrap_addr}{Paths.BOOTSTRAP_HEARTBEAT}?decode_boot={decode_boot}", None, done)

    def abort_prefill(self, bootstrap_addr: str, room: int, reason: str) -> None:
        self._submit("POST", bootstrap_addr + Paths.BOOTSTRAP_ABORT, AbortRoom(room, reason).wire(), None)

    def abort_decode(self, decode_url: str, room: int, reason: str) -> None:
        self._submit("POST", decode_url + Paths.PD_ABORT, AbortRoom(room, reason).wire(), None)

    def _submit(self, method: str, url: str, body: Optional[dict], done: Optional[Done]) -> None:
        self._pool.submit(self._call, method, url, body, done)

    def _call(self, method: str, url: str, body: Optional[dict], done: Optional[Done]) -> None:
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
