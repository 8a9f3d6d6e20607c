"""Relaying a decode engine's SSE stream to the client.

`RelayResponse` watches the client itself, whatever ASGI version the server speaks, and runs
its cleanup (close the decode stream, free the admission slot) exactly once however the stream
ends: finished, client gone, upstream broken, or the server shutting down. A stream that breaks
upstream ends with an OpenAI-shaped error event and [DONE], never a silent cut or a hang.

Its `Outlet` lets the relay write an event to the client from the upstream connection's own
read callback, without waking the relaying task: at fleet rates a relayed token is one plain
event, and the wake-up, the generator step and the layers of awaited `send`s per event were most
of the router's CPU per token (bench/suites/relay_bench.py). The ASGI `send` chain completes
without suspending unless the client's socket is backed up; when it does suspend, the write
finishes in a task and everything after it takes the ordinary path, in order. Under uvicorn's
httptools server the outlet frames the chunk and writes it to the connection itself (`raw_body`),
which is what that server's `send` does for a body message once the head is out, less the
message, the coroutine and its checks per token; anything else (a backed-up or gone client, the
end of the answer) still goes through `send`.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Callable, Optional

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

try:
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle
except ImportError:  # no httptools: uvicorn's h11 server, every event through `send`
    RequestResponseCycle = None

from dsv4_router.hangup import SCOPE_KEY as HANGUP
from dsv4_wire import APIError
from dsv4_wire.slow_clients import SEND_AFTER_BODY


def sse(obj) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def error_events(message: str, status: int = 502) -> bytes:
    return sse(APIError(message, status, "server_error").body()) + sse("[DONE]")


def first_event_error(event: bytes) -> Optional[bytes]:
    """The JSON of an error event, when the stream's first event is one (else None). Pure."""
    if not event.startswith(b"data: "):
        return b""
    data = event[6:].strip()
    if data == b"[DONE]":
        return b""  # a stream that ends before producing anything failed too
    try:
        obj = json.loads(data)
    except ValueError:
        return b""
    return data if isinstance(obj, dict) and "error" in obj else None


def split_events(buf: bytes) -> tuple[bytes, bytes]:
    """(the whole SSE events at the front of buf, the partial rest). Pure."""
    cut = buf.rfind(b"\n\n") + 2
    return (buf[:cut], buf[cut:]) if cut >= 2 else (b"", buf)


async def _finish(coro, waiting_on) -> None:
    """Run to its end a coroutine that was started by hand and suspended on `waiting_on`."""
    while True:
        try:
            await waiting_on
        except BaseException:
            pass  # the coroutine reads the outcome itself when resumed
        try:
            waiting_on = coro.send(None)
        except StopIteration:
            return


def raw_body(send: Send) -> Optional[Callable[[bytes], bool]]:
    """For the `send` of uvicorn's httptools server, once a chunked answer's head is out: a
    function that writes a body chunk to the connection as that `send` would (True), or leaves
    it to `send` (False) when the client is backed up or gone or the answer is over. Else None."""
    cycle = getattr(send, "__self__", None)
    if RequestResponseCycle is None or type(cycle) is not RequestResponseCycle:
        return None
    if cycle.chunked_encoding is not True or cycle.scope.get("method") == "HEAD":
        return None
    transport, flow = cycle.transport, cycle.flow

    def write(data: bytes) -> bool:
        if flow.write_paused or cycle.disconnected or cycle.response_complete:
            return False
        if data:
            transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return True

    return write


class Outlet:
    """Writes to the client outside the relaying task, when nothing it yielded is still unsent."""

    def __init__(self) -> None:
        self.send: Optional[Send] = None  # set once the answer's head is sent
        self.raw: Optional[Callable[[bytes], bool]] = None  # `send`'s write, without it (raw_body)
        self.queued = False  # the stream loop holds an event from the relay not yet sent
        self.behind: Optional[asyncio.Future] = None  # a write that had to wait for the socket

    def ready(self) -> bool:
        return self.send is not None and not self.queued and (self.behind is None or self.behind.done())

    def write(self, data: bytes) -> bool:
        """Send `data` now; False (nothing sent) when it must go the ordinary way."""
        return self.pass_on(data, _same)

    def pass_on(self, chunk: bytes, convert: Callable[[bytes], Optional[bytes]]) -> bool:
        """Send `convert(chunk)` now, when it may go now and `convert` gives bytes (not None);
        `convert` runs only then (it may record what it passed). False: nothing sent."""
        if self.send is None or self.queued:
            return False
        if self.behind is not None:
            if not self.behind.done():
                return False
            self.behind = None
        data = convert(chunk)
        if data is None:
            return False
        if self.raw is not None and self.raw(data):
            return True
        coro = self.send({"type": "http.response.body", "body": data, "more_body": True})
        try:
            waiting_on = coro.send(None)
        except StopIteration:
            return True
        except BaseException as e:  # raised again where the stream loop sends next
            self.behind = asyncio.get_running_loop().create_future()
            self.behind.set_exception(e)
            return True
        self.behind = asyncio.ensure_future(_finish(coro, waiting_on))
        return True


def _same(data: bytes) -> bytes:
    return data


_HEADERS = StreamingResponse((), media_type="text/event-stream").raw_headers  # what it would build each time


class RelayResponse(StreamingResponse):
    def __init__(
        self,
        content: AsyncIterator[bytes],
        on_close: Callable[[], "asyncio.Future | None"],
        outlet: Optional[Outlet] = None,
    ):
        # StreamingResponse's own __init__, less its checks and header building (one per request)
        self.body_iterator = content
        self.status_code = 200
        self.media_type = "text/event-stream"
        self.background = None
        self.raw_headers = list(_HEADERS)
        self._on_close = on_close
        self._closed = False
        self.outlet = outlet or Outlet()

    def translate(self, wrap: Callable[[AsyncIterator[bytes]], AsyncIterator[bytes]]) -> None:
        """Put a translation (the agent APIs' events) between the relay and the client: every
        event then passes through it, none straight from the engine's connection (the relay's
        outlet is left without the client's send, so it is never ready)."""
        self.body_iterator = wrap(self.body_iterator)
        self.outlet = Outlet()

    async def stream_response(self, send: Send) -> None:
        out = self.outlet
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        out.send = send
        out.raw = raw_body(send)
        async for chunk in self.body_iterator:
            out.queued = True
            if out.behind is not None:
                await out.behind
                out.behind = None
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            out.queued = False
        out.queued = True  # the end goes after everything
        if out.behind is not None:
            await out.behind
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hang = scope.get(HANGUP)
        if hang is not None:  # the fast lane's request: its watch cancels this task (hangup.py)
            return await self._watched(scope.get(SEND_AFTER_BODY, send), hang)
        stream = asyncio.ensure_future(self.stream_response(send))
        gone = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (stream, gone):
                t.cancel()
            await asyncio.gather(stream, gone, return_exceptions=True)
            await self.close()
        if (
            stream.done()
            and not stream.cancelled()
            and stream.exception() is not None
            and not isinstance(stream.exception(), OSError)
        ):
            raise stream.exception()  # a bug, not a client gone: let the server log it

    async def _watched(self, send: Send, hang) -> None:
        """The stream in this task; a hang-up cancels it (no task and no wait of its own)."""
        try:
            await self.stream_response(send)
            hang.ended = True
        except asyncio.CancelledError:
            if not hang.caught():
                raise
        except OSError:
            pass  # the client is gone
        finally:
            await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.outlet.send = self.outlet.raw = None  # nothing more goes to the client from outside the stream loop
        try:
            await self.body_iterator.aclose()  # runs the relay's finally if it is parked at a yield
        finally:
            await self._on_close()
