"""The router's cost per request: a streamed request through the fast lane (fastlane.py) is
served by the request's own task plus two (the hang-up watch, the engine attempt), where it
took five (a work task, two hang-up listeners, a streaming task, the attempt) and two
asyncio.waits; and the hang-up watch cancels only what it should (hangup.py)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from bench.harness.commands import free_port
from bench.suites.relay_bench import Stub
from dsv4_router.app import build_app
from dsv4_router.hangup import Hangup
from dsv4_router.router import Router
from dsv4_router.router_args import RouterArgs


@pytest.mark.asyncio
async def test_a_streamed_request_takes_two_tasks_of_the_router() -> None:
    port = free_port()
    stub = Stub(0.005, 4)  # the relay bench's engine: SSE chunks shaped as the engine's
    server = await asyncio.start_server(stub.handle, "127.0.0.1", port)
    ticking = asyncio.create_task(stub.tick())
    router = Router(RouterArgs(mono=[f"http://127.0.0.1:{port}"], cache_events=False))
    await router.start()
    loop = asyncio.get_running_loop()
    made: list[str] = []

    def counting(loop, coro, **kw):
        made.append(getattr(coro, "__qualname__", repr(coro)))
        return asyncio.Task(coro, loop=loop, **kw)

    transport = httpx.ASGITransport(app=build_app(router))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            body = {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            got = await c.post("/v1/chat/completions", json=body)  # warm: connections, caches
            assert got.status_code == 200 and got.text.count("tok ") == 3
            loop.set_task_factory(counting)
            got = await c.post("/v1/chat/completions", json=body)
            loop.set_task_factory(None)
        assert got.status_code == 200 and got.text.count("tok ") == 3 and got.text.endswith("data: [DONE]\n\n")
        assert len(made) <= 2, made
        assert router.admission.inflight == 0  # the stream gave its slot back
    finally:
        loop.set_task_factory(None)
        await router.stop()
        ticking.cancel()
        server.close()


@pytest.mark.asyncio
async def test_the_hangup_watch_cancels_the_work_only_before_the_answer_ends() -> None:
    gone = asyncio.Event()

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    async def serve() -> str:
        hang = Hangup(receive)
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            assert hang.caught() and hang.left
            await asyncio.sleep(0)  # taken back: the task goes on (its cleanup may await)
            return "client left"
        finally:
            await hang.close()
        return "answered"

    task = asyncio.create_task(serve())
    await asyncio.sleep(0.01)
    gone.set()
    assert await task == "client left" and not task.cancelled()

    gone.clear()

    async def answered() -> bool:
        hang = Hangup(receive)
        hang.ended = True  # the answer's last byte went: the server's "disconnect" is its end
        gone.set()
        await asyncio.sleep(0.01)
        await hang.close()
        return hang.left

    assert await answered() is False

    async def not_ours() -> None:  # another cancellation is not taken for a hang-up
        hang = Hangup(receive)
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            assert not hang.caught()
            raise
        finally:
            await hang.close()

    gone.clear()
    task = asyncio.create_task(not_ours())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
