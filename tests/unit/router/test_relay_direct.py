"""The direct relay path: token events written to the client from the engine connection's read
callback (stream_client sink + relay.Outlet) keep their order behind a client that is backed up,
and a read that waits while the sink takes the data does not time out on a flowing stream."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from bench.harness.commands import free_port
from dsv4_router.relay import Outlet
from dsv4_router.stream_client import StreamClient


class Served:
    def __init__(self, server: asyncio.Server, handlers: set):
        self.server, self.handlers = server, handlers

    async def stop(self) -> None:
        self.server.close()
        for t in self.handlers:
            t.cancel()
        await asyncio.gather(*self.handlers, return_exceptions=True)
        await self.server.wait_closed()


async def _serve_chunks(port: int, chunks: list[bytes], gap: float, ready: asyncio.Event) -> Served:
    handlers: set = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.add(asyncio.current_task())
        try:
            await answer(reader, writer)
        finally:
            writer.close()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        await reader.readexactly(n)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for c in chunks:
            await asyncio.sleep(gap)
            writer.write(b"%x\r\n%s\r\n" % (len(c), c))
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()  # until the client closes

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    ready.set()
    return Served(server, handlers)


@pytest.mark.asyncio
async def test_a_read_waiting_while_the_sink_takes_every_chunk_does_not_time_out() -> None:
    port = free_port()
    ready = asyncio.Event()
    chunks = [b"data: %d\n\n" % i for i in range(8)]
    server = await _serve_chunks(port, chunks, 0.1, ready)  # 0.8 s of data, 0.1 s apart
    client = StreamClient({}, 4, read_timeout=0.35)
    try:
        resp = await client.post(f"http://127.0.0.1:{port}/x", {})
        taken: list[bytes] = []
        resp.sink = lambda b: taken.append(b) or True
        rest = [c async for c in resp]  # waits ~0.8 s, longer than read_timeout, with data flowing
        assert b"".join(taken) == b"".join(chunks) and rest == []
    finally:
        await client.aclose()
        await server.stop()


@pytest.mark.asyncio
async def test_a_silent_engine_still_times_out_the_waiting_read() -> None:
    port = free_port()
    ready = asyncio.Event()
    server = await _serve_chunks(port, [b"data: 0\n\n", b"data: 1\n\n"], 3.0, ready)
    client = StreamClient({}, 4, read_timeout=0.3)
    try:
        resp = await client.post(f"http://127.0.0.1:{port}/x", {})
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(httpx.ReadTimeout):
            await resp.__anext__()
        assert 0.25 <= loop.time() - t0 < 2.5  # well before the first chunk (3 s)
        await resp.aclose()
    finally:
        await client.aclose()
        await server.stop()


@pytest.mark.asyncio
async def test_writes_behind_a_backed_up_client_keep_their_order() -> None:
    sent: list[bytes] = []
    drained = asyncio.Event()
    paused = [False]

    async def send(message: dict) -> None:  # uvicorn's send: waits for the socket while it is paused
        if paused[0]:
            await drained.wait()
        sent.append(message.get("body", b""))

    out = Outlet()
    assert not out.write(b"0")  # no head sent yet: the ordinary way
    out.send = send
    assert out.write(b"1") and sent == [b"1"]  # completed without suspending
    paused[0] = True
    assert out.write(b"2")  # taken, waits for the socket in a task
    assert not out.ready() and not out.write(b"3")  # everything after it goes the ordinary way
    paused[0] = False
    drained.set()
    await out.behind
    assert out.ready() and out.write(b"4")
    assert sent == [b"1", b"2", b"4"]
    out.queued = True  # the stream loop holds an event of its own: it goes first
    assert not out.ready() and not out.write(b"5")
