"""The relay's client facing an engine that accepts a connection and drops it at once (a dying
engine's socket): the request fails as a connection failure the router re-places, not as a
RuntimeError from writing to a closed transport (uvloop raises there; the router then answered
the client with a cut stream)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import uvloop

from dsv4_router.stream_client import StreamClient, _Conn, _send


def _run(coro) -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:  # the router's loop
        runner.run(coro)


def test_a_request_on_a_closed_transport_is_not_sent():
    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = StreamClient({}, max_connections=2, read_timeout=2)
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(lambda: _Conn(("127.0.0.1", port), client), "127.0.0.1", port)
        assert _send(conn, b"GET / HTTP/1.1\r\n\r\n")
        conn.transport.close()
        await asyncio.sleep(0.05)  # the handle is closed on a later turn of the loop
        with pytest.raises(RuntimeError):  # what post() did before: the router's answer was cut
            conn.transport.write(b"GET / HTTP/1.1\r\n\r\n")
        assert not _send(conn, b"GET / HTTP/1.1\r\n\r\n")
        server.close()
        await server.wait_closed()

    _run(main())


def test_an_engine_that_drops_every_connection_is_a_connection_failure():
    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = StreamClient({}, max_connections=2, read_timeout=2)
        with pytest.raises((httpx.ConnectError, httpx.RemoteProtocolError)):
            await client.post(f"http://127.0.0.1:{port}/v1/completions", {"prompt": "x"})
        assert not client._slots.locked()  # its slot came back
        server.close()
        await server.wait_closed()

    _run(main())
