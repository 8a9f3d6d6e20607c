"""The generation routes without FastAPI's middleware, routing, dependency solving and exception
layers.

Every event of a relayed stream used to pass the `send` wrappers of FastAPI/Starlette's error
middleware, and every request its middleware stack, router and dependency machinery; at fleet
rates that is a share of the router's CPU per token and per request
(bench/suites/relay_bench.py). This dispatcher, in front of the FastAPI app, answers POSTs to
the generation paths itself with the router's own `handle`, behind the same API-key and tenancy
gates as the app (`gates`: the same instances' limits, metrics and keys), and passes everything
else (the agent APIs, admin, health, metrics, lifespan) to the app.

An exception before the answer starts gets the app's 500 (`on_error`, the same answer the app's
exception handler gives); one while a stream is being sent ends it as before (the server logs it
and closes the connection). The request's hang-up watch (hangup.py) is set up by `handle` once
the body is read, and closed here when the answer is over.
"""

from __future__ import annotations

from typing import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from dsv4_router.hangup import SCOPE_KEY as HANGUP
from dsv4_wire import Paths

GENERATION = frozenset({Paths.COMPLETIONS, Paths.CHAT_COMPLETIONS})


class FastLane:
    def __init__(
        self,
        app,
        handle: Callable[[str, Request], Awaitable[Response]],
        on_error: Callable,
        gates: Callable = lambda inner: inner,
    ):
        self.app = app
        self.handle = handle
        self.on_error = on_error
        self.lane = gates(self._serve)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GENERATION:
            return await self.app(scope, receive, send)
        await self.lane(scope, receive, send)

    async def _serve(self, scope, receive, send) -> None:
        scope[HANGUP] = None  # handle() may watch for a hang-up (hangup.py) once the body is read
        http = Request(scope, receive)
        try:
            try:
                response = await self.handle(scope["path"], http)
            except Exception as e:
                response = await self.on_error(http, e)
            await response(scope, receive, send)
        finally:
            if scope[HANGUP] is not None:
                await scope[HANGUP].close()
