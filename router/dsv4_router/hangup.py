"""One watch per request for a client that hangs up, from its body's end to its answer's end.

A client that leaves (queued, being placed, or mid-stream) cancels the work: closing the upstream
connections is what makes the engines abort. Watching for it took two tasks and an
`asyncio.wait` in the handler, then two more and another wait in the streaming response: at
fleet rates (a request every few milliseconds) that churn was a large share of the router's CPU
per request (bench/suites/relay_bench.py). Here one task waits for the ASGI `http.disconnect`
and, if the answer has not ended, cancels the task serving the request, which runs its work
inline; `caught` tells that cancellation from any other.

The ASGI server ends a waiting `receive` once the answer is complete too (uvicorn, httpx's
ASGITransport): `ended` says the answer's last byte went, so that is not a hang-up.
"""

from __future__ import annotations

import asyncio
from typing import Optional

SCOPE_KEY = "dsv4.hangup"  # where the fast lane's serving task finds its request's watch


async def _until_disconnect(receive) -> None:
    # The body is read: the next ASGI message is the disconnect, whenever it comes.
    while (await receive())["type"] != "http.disconnect":
        pass


class Hangup:
    def __init__(self, receive) -> None:
        self.task: Optional[asyncio.Task] = asyncio.current_task()  # what a hang-up cancels
        self.ended = False  # the answer is sent: a disconnect now is no hang-up
        self.left = False  # the client hung up before the answer ended
        self._fired = False  # a cancellation of ours is on its way to `task`
        self._watch = asyncio.ensure_future(_until_disconnect(receive))
        self._watch.add_done_callback(self._disconnected)

    def _disconnected(self, watch: asyncio.Future) -> None:
        if watch.cancelled() or self.ended:
            return
        self.left = True
        if self.task is not None and not self.task.done():
            self._fired = True
            self.task.cancel()

    def caught(self) -> bool:
        """Inside `except CancelledError`: whether it was this watch's (the client left); then
        it is taken back (the serving task goes on to clean up). Else re-raise it."""
        if not self._fired:
            return False
        self._fired = False
        self.task.uncancel()
        return True

    async def close(self) -> None:
        """The answer is over: stop watching; a cancellation fired just as the work ended (not
        yet delivered) is absorbed here, not at the server's next await."""
        self.ended = True
        self._watch.cancel()
        if self._fired:
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                pass
            self.caught()
