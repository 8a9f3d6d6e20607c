"""The router's HTTP/1.1 client for the streams it relays: every token of every stream passes
through it, so it is built for that and nothing else.

One asyncio Protocol per connection, httptools' C parser (the parser uvicorn uses on the
server side) feeding the body straight into the response's buffer: no per-chunk event objects,
state machines or task-local context as in httpx/httpcore/h11, which cost the relay most of its
CPU per token (bench/suites/relay_bench.py). Keep-alive connections are pooled per host, bounded.

Its answers look like httpx's where the router uses them (`status_code`, `aread`, `aiter_raw`,
`aclose`) and its failures are httpx's exception types, so the router tells an engine that
cannot be reached (ConnectError, ConnectTimeout) from one whose stream broke (ReadError,
RemoteProtocolError, WriteError) the same way for both clients.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from typing import AsyncIterator, Callable, Optional
from urllib.parse import urlsplit

import httptools
import httpx

HIGH_WATER = 1 << 20  # buffered body bytes at which the connection stops reading (the client is slow)


class _Conn(asyncio.Protocol):
    def __init__(self, key: tuple, pool: "StreamClient"):
        self.key, self.pool = key, pool
        self.transport: Optional[asyncio.Transport] = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: Optional[StreamResponse] = None
        self.lost: Optional[Exception] = None
        self.idle_since = 0.0
        self.paused = False

    # -- asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(httpx.RemoteProtocolError(f"malformed answer: {e}"))
            self.transport.close()

    def eof_received(self):
        return None  # close

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.lost = exc or ConnectionResetError("connection closed")
        self.pool._forget(self)
        r = self.resp
        if r is not None and not r.complete:
            if r.status_code is None:
                r._fail(httpx.RemoteProtocolError("the engine closed the connection without answering"))
            else:
                r._fail(httpx.ReadError("the engine's stream broke off"))

    # -- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if self.resp is not None:
            self.resp.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        r = self.resp
        if r is not None:
            r.status_code = self.parser.get_status_code()
            if not r._head.done():
                r._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        r = self.resp
        if r is not None:
            r._last = r._loop.time()
            if r.sink is not None and not r._chunks and r.sink(body):
                return  # relayed as it came: no buffer, no wake-up of the reading task
            r._chunks.append(body)
            r._buffered += len(body)
            if r._buffered > HIGH_WATER and not self.paused:
                self.paused = True
                self.transport.pause_reading()
            r._wake()

    def on_message_complete(self) -> None:
        r = self.resp
        if r is not None:
            r.complete = True
            r._keep = self.parser.should_keep_alive()
            r._wake()

    def _fail(self, e: Exception) -> None:
        if self.resp is not None:
            self.resp._fail(e)

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.transport.is_closing():
            self.paused = False
            self.transport.resume_reading()


async def _bounded(aw, timeout: float, timed_out, undo):
    """`await aw` within `timeout` seconds (else raise timed_out()). Unlike asyncio.wait_for on
    Python < 3.12, a cancellation of the caller is never lost when `aw` completes at the same
    moment: it is raised, and what `aw` produced is undone (`undo(result)`: a connection closed,
    a slot given back)."""
    fut = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({fut}, timeout=timeout)
    except BaseException:
        _abandon(fut, undo)
        raise
    if not done:
        _abandon(fut, undo)
        raise timed_out()
    return fut.result()


def _abandon(fut: asyncio.Future, undo) -> None:
    fut.cancel()

    def settle(f: asyncio.Future) -> None:
        if not f.cancelled() and f.exception() is None:
            undo(f.result())

    fut.add_done_callback(settle)


class StreamResponse:
    def __init__(self, conn: _Conn, read_timeout: float):
        self._conn = conn
        self._read_timeout = read_timeout
        self.status_code: Optional[int] = None
        self.headers: dict[str, str] = {}
        self.complete = False
        self._keep = False
        self._chunks: deque = deque()
        self._buffered = 0
        self._error: Optional[Exception] = None
        self._waiter: Optional[asyncio.Future] = None
        self._loop = asyncio.get_running_loop()
        self._head: asyncio.Future = self._loop.create_future()
        self._closed = False
        self._last = 0.0  # when body bytes last came, or a read began to wait
        self._timer: Optional[asyncio.TimerHandle] = None
        # Set by the reader while it waits with nothing half-read: called with each body chunk
        # as it arrives; True when it took the chunk (relayed it), False to have it buffered
        # and the reader woken as usual.
        self.sink: Optional[Callable[[bytes], bool]] = None

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(False)

    def _fail(self, e: Exception) -> None:
        if self._error is None:
            self._error = e
        if not self._head.done():
            self._head.set_exception(e)
            self._head.exception()  # retrieved: no warning when nobody waits any more
        self._wake()

    async def _next(self) -> Optional[bytes]:
        """The next body bytes (all that are buffered), or None at the end of the body."""
        while True:
            if self._chunks:
                data = b"".join(self._chunks) if len(self._chunks) > 1 else self._chunks[0]
                self._chunks.clear()
                self._buffered = 0
                self._conn.resume()
                return data
            if self.complete:
                self._release()
                return None
            if self._error is not None:
                raise self._error
            w = self._waiter = self._loop.create_future()
            self._last = self._loop.time()
            if self._timer is None:
                self._timer = self._loop.call_at(self._last + self._read_timeout, self._check_silence)
            try:
                await w
            finally:
                self._waiter = None
            if w.result():
                raise httpx.ReadTimeout(f"the engine said nothing for {self._read_timeout:g}s")

    def _no_head(self) -> None:
        if not self._head.done():
            self._head.set_exception(httpx.ReadTimeout(f"the engine did not answer in {self._read_timeout:g}s"))

    def _check_silence(self) -> None:
        """The read timeout: one timer per answer, moved on only when it fires (not armed and
        cancelled around every chunk); a waiting read times out once nothing came for a whole
        read_timeout, counted from the later of its start and the last body bytes."""
        self._timer = None
        w = self._waiter
        if w is None or w.done() or self._closed:
            return
        due = self._last + self._read_timeout
        if self._loop.time() >= due:
            w.set_result(True)
        else:
            self._timer = self._loop.call_at(due, self._check_silence)

    def _stop_timer(self) -> None:
        self.sink = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def aiter_raw(self) -> AsyncIterator[bytes]:
        return self  # its own iterator: one layer less per chunk than an async generator

    def __aiter__(self) -> "StreamResponse":
        return self

    async def __anext__(self) -> bytes:
        data = await self._next()
        if data is None:
            raise StopAsyncIteration
        return data

    async def aread(self) -> bytes:
        parts = []
        while True:
            data = await self._next()
            if data is None:
                return b"".join(parts)
            parts.append(data)

    def interrupt(self, e: Exception) -> None:
        """From another task: the read waiting on this answer raises `e` now (the router gave
        up on a frozen engine, which would never close the connection itself)."""
        self._fail(e)

    def _release(self) -> None:
        if not self._closed:
            self._stop_timer()
            self._closed = True
            self._conn.resp = None
            self._conn.pool._done(self._conn, reuse=self._keep and self._error is None)

    async def aclose(self) -> None:
        """Done with it: a connection whose answer was not read to its end is closed (the
        engine sees the client go and aborts the request)."""
        if self._closed:
            return
        if self.complete and self._error is None and not self._chunks:
            self._release()
            return
        self._stop_timer()
        self._closed = True
        self._conn.resp = None
        if self._conn.transport is not None:
            self._conn.transport.close()
        self._conn.pool._done(self._conn, reuse=False)


def _send(conn: _Conn, data: bytes) -> bool:
    """Write a request; False when the transport closed first (the peer reset the connection
    right after accepting it, as a dying engine's socket does: uvloop raises on such a write)."""
    if conn.transport is None or conn.transport.is_closing():
        return False
    try:
        conn.transport.write(data)
    except RuntimeError:
        return False
    return True


class StreamClient:
    def __init__(
        self,
        headers: dict,
        max_connections: int,
        read_timeout: float,
        connect_timeout: float = 5.0,
        pool_timeout: float = 10.0,
        keepalive_expiry: float = 10.0,
    ):
        self.headers = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items())
        self.read_timeout, self.connect_timeout = read_timeout, connect_timeout
        self.pool_timeout, self.keepalive_expiry = pool_timeout, keepalive_expiry
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: dict[tuple, list[_Conn]] = {}
        self._open: set[_Conn] = set()

    async def post(self, url: str, body: dict, headers: Optional[dict] = None) -> StreamResponse:
        """Send a JSON POST; returns once the answer's status and headers are in."""
        u = urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise httpx.UnsupportedProtocol(f"the relay client speaks plain http, not {url}")
        key = (u.hostname, u.port or 80)
        payload = json.dumps(body, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
        extra = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in (headers or {}).items())
        target = (u.path or "/") + (f"?{u.query}" if u.query else "")
        head = (
            f"POST {target} HTTP/1.1\r\nhost: {u.netloc}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\n"
        ).encode("latin-1")
        request = head + self.headers + extra + b"\r\n" + payload
        if not self._slots.locked():
            await self._slots.acquire()  # free: returns without suspending (no task, no timer)
        else:
            await _bounded(
                self._slots.acquire(),
                self.pool_timeout,
                lambda: httpx.PoolTimeout("no connection to the engine came free in time"),
                lambda _: self._slots.release(),
            )
        ok = False
        try:
            for attempt in range(2):
                conn, reused = await self._conn(key)
                resp = StreamResponse(conn, self.read_timeout)
                conn.resp = resp
                if not _send(conn, request):  # closed before a byte went: the engine is going away
                    conn.resp = None
                    if conn.transport is not None:
                        conn.transport.close()
                    if reused and attempt == 0:
                        continue
                    raise httpx.ConnectError(f"the connection to {key[0]}:{key[1]} closed before the request went")
                # the head's own future, failed by a timer: no asyncio.wait (sets, callbacks) per request
                timer = resp._loop.call_later(self.read_timeout, resp._no_head)
                try:
                    await resp._head
                except httpx.RemoteProtocolError:
                    if reused and attempt == 0 and not resp.headers:
                        continue  # the engine had closed that idle connection: once more, on a new one
                    raise
                except BaseException:
                    conn.resp = None
                    conn.transport.close()
                    raise
                finally:
                    timer.cancel()
                ok = True
                return resp
            raise AssertionError("unreachable")
        finally:
            if not ok:
                self._slots.release()

    async def _conn(self, key: tuple) -> tuple[_Conn, bool]:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            c = idle.pop()
            if c.lost is None and not c.transport.is_closing() and now - c.idle_since < self.keepalive_expiry:
                return c, True
            c.transport.close()
        loop = asyncio.get_running_loop()
        try:
            _, c = await _bounded(
                loop.create_connection(lambda: _Conn(key, self), key[0], key[1]),
                self.connect_timeout,
                lambda: httpx.ConnectTimeout(f"no connection to {key[0]}:{key[1]} in {self.connect_timeout:g}s"),
                lambda made: made[0].close(),
            )
        except OSError as e:
            raise httpx.ConnectError(f"cannot connect to {key[0]}:{key[1]}: {e}") from None
        self._open.add(c)
        return c, False

    def _done(self, c: _Conn, reuse: bool) -> None:
        """A response is over: its connection goes back to the pool or is closed; its slot frees."""
        self._slots.release()
        if reuse and c.lost is None and not c.transport.is_closing():
            c.idle_since = time.monotonic()
            self._idle.setdefault(c.key, []).append(c)
        elif c.transport is not None:
            c.transport.close()

    def _forget(self, c: _Conn) -> None:
        self._open.discard(c)
        idle = self._idle.get(c.key)
        if idle and c in idle:
            idle.remove(c)

    async def aclose(self) -> None:
        for c in list(self._open):
            if c.transport is not None:
                c.transport.close()
        self._open.clear()
        self._idle.clear()
