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


class _Wire:
    """A client connection's transport: records what the server writes."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, b: bytes) -> None:
        self.data += b

    def is_closing(self) -> bool:
        return False


def _uvicorn_cycle(wire: _Wire):
    import logging

    from uvicorn.protocols.http.flow_control import FlowControl
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    log = logging.getLogger("test")
    scope = {"type": "http", "method": "POST"}
    return RequestResponseCycle(scope, wire, FlowControl(wire), log, log, False, [], asyncio.Event(), False, True, id)


@pytest.mark.asyncio
async def test_the_raw_write_puts_on_the_wire_what_uvicorns_send_would() -> None:
    from dsv4_router.relay import raw_body

    start = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
    events = [b"data: 1\n\n", b"", b'data: {"x": 2}\n\n']
    by_send, by_raw = _Wire(), _Wire()
    plain, raw = _uvicorn_cycle(by_send), _uvicorn_cycle(by_raw)
    assert raw_body(raw.send) is None  # no head yet: framing unknown
    for cycle in (plain, raw):
        await cycle.send(start)
    write = raw_body(raw.send)
    for e in events:
        await plain.send({"type": "http.response.body", "body": e, "more_body": True})
        assert write(e)
    assert bytes(by_raw.data) == bytes(by_send.data)
    # a backed-up or gone client, or an answer that is over: left to `send` (it waits or drops)
    raw.flow.write_paused = True
    assert not write(b"data: 3\n\n")
    raw.flow.write_paused = False
    raw.disconnected = True
    assert not write(b"data: 3\n\n")
    assert bytes(by_raw.data) == bytes(by_send.data)
    assert raw_body(lambda message: None) is None  # another server's send: always `send`
