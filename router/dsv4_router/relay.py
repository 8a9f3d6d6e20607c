"""Relaying a decode engine's SSE stream to the client.

`RelayResponse` watches the client itself, whatever ASGI version the server speaks, and runs
its cleanup (close the decode stream, free the admission slot) exactly once however the stream
ends: finished, client gone, upstream broken, or the server shutting down. A stream that breaks
upstream ends with an OpenAI-shaped error event and [DONE], never a silent cut or a hang.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Callable, Optional

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from dsv4_wire import APIError


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


class RelayResponse(StreamingResponse):
    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], "asyncio.Future | None"]):
        super().__init__(content, media_type="text/event-stream")
        self._on_close = on_close
        self._closed = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self.body_iterator.aclose()  # runs the relay's finally if it is parked at a yield
        finally:
            await self._on_close()
