"""Bounds on slow and many clients for every dsv4 HTTP server (engines, the prefill's bootstrap
server, the router), issue 39:

- a connection must deliver a request's headers within `timeout` seconds of opening (or of its
  previous response): a client that trickles header bytes (slowloris) is cut off;
- a request's body must arrive within `timeout` seconds of its headers, else 408 and the
  connection closes;
- at most `max_connections` connections and requests at once (uvicorn's limit_concurrency:
  more get 503).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Fast
except ImportError:  # httptools not installed: uvicorn's pure-Python parser
    _Fast = H11Protocol  # type: ignore[misc,assignment]


def header_deadline_protocol(seconds: float) -> type:
    """uvicorn's HTTP protocol, closing a connection that has not completed a request's headers
    within `seconds` of opening or of its previous response."""

    class HeaderDeadline(_Fast):  # type: ignore[misc,valid-type]
        _waiting = 0  # which wait for headers is current (a late timer of an earlier one is void)

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def _arm(self) -> None:
            self._waiting += 1
            self.loop.call_later(seconds, self._deadline, self._waiting)

        def _deadline(self, waiting: int) -> None:
            if waiting != self._waiting or self.transport.is_closing():
                return
            if self.cycle is None or self.cycle.response_complete:  # still no whole request head
                self.transport.close()

    return HeaderDeadline


# Once the whole body is in, the guard below can no longer fire: the server's own `send` is left
# here for an app that sends many messages (the router's relayed streams: one per token) to call
# without the guard's extra layer.
SEND_AFTER_BODY = "dsv4.send_after_body"


class BodyDeadline:
    """ASGI middleware (outside the app, so that no exception handler turns it into a 500): a
    request body that has not fully arrived `seconds` after the headers ends the request; the
    app sees the client as gone, and the client gets 408 with the connection closed."""

    def __init__(self, app, seconds: float):
        self.app = app
        self.seconds = seconds

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.seconds
        body_done, timed_out, started = False, False, False

        async def timed_receive():
            nonlocal body_done, timed_out
            if body_done or timed_out:
                return await receive()  # after the body: the disconnect, whenever it comes
            try:  # a timeout scope, not wait_for: no task per message (the router's cost per request)
                async with asyncio.timeout_at(deadline):
                    msg = await receive()
            except TimeoutError:
                timed_out = True
                return {"type": "http.disconnect"}
            if msg["type"] != "http.request" or not msg.get("more_body", False):
                body_done = True
                scope[SEND_AFTER_BODY] = send
            return msg

        async def guarded_send(message):
            nonlocal started
            if timed_out:
                return  # the 408 below answers
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, timed_receive, guarded_send)
        if timed_out and not started:
            body = json.dumps(
                {
                    "error": {
                        "message": f"the request body did not arrive within {self.seconds:g} s",
                        "type": "invalid_request_error",
                        "param": None,
                        "code": "request_timeout",
                    }
                }
            ).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 408,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"connection", b"close"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})


def bounded(app, timeout: float, max_connections: int) -> tuple[Any, dict]:
    """(the app wrapped, uvicorn.Config keyword arguments) for a server with these bounds."""
    return BodyDeadline(app, timeout), {
        "http": header_deadline_protocol(timeout),
        "limit_concurrency": max_connections,
        "timeout_keep_alive": min(5.0, timeout),
    }
