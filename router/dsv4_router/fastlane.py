"""The generation routes without FastAPI's routing, dependency solving and exception layers.

Every event of a relayed stream used to pass two exception-handling `send` wrappers of
FastAPI/Starlette, and every request its router and dependency machinery; at fleet rates that
is a share of the router's CPU per token (bench/suites/relay_bench.py). This innermost middleware
(inside the API-key and tenancy gates, which still see every request) answers POSTs to the
generation paths itself with the router's own `handle`, and passes everything else on.

An exception before the answer starts gets the app's 500 (`on_error`, the same answer the
app's exception handler gives); one while a stream is being sent ends it as before.
"""

from __future__ import annotations

from typing import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from dsv4_wire import Paths

GENERATION = frozenset({Paths.COMPLETIONS, Paths.CHAT_COMPLETIONS})


class FastLane:
    def __init__(self, app, handle: Callable[[str, Request], Awaitable[Response]], on_error: Callable):
        self.app = app
        self.handle = handle
        self.on_error = on_error

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GENERATION:
            return await self.app(scope, receive, send)
        http = Request(scope, receive)
        try:
            response = await self.handle(scope["path"], http)
        except Exception as e:
            response = await self.on_error(http, e)
        await response(scope, receive, send)
