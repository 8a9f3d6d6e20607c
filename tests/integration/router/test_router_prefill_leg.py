"""The prefill leg of a PD request, with scripted engines behind a real router process: when the
prefill engine refuses or fails a request before decode has sent a byte, the client hears it at
once instead of after decode's deadline for KV that will never come."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from bench.harness.commands import Proc, free_port


class Scripted:
    """A fake prefill (answers with `status`) and a fake decode (answers /ready, then holds every
    request open without a byte), recording what the router sent each."""

    def __init__(self) -> None:
        self.status = 400
        self.prefill_bodies: list[dict] = []
        self.decode_bodies: list[dict] = []
        self.p_port, self.b_port, self.d_port = free_port(), free_port(), free_port()

    def prefill_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/ready")
        async def ready():
            return {"ready": True}

        @app.get("/server_info")
        async def info():
            return {"role": "prefill", "bootstrap_port": self.b_port}

        @app.post("/v1/completions")
        async def completions(http: Request):
            self.prefill_bodies.append(await http.json())
            # the router sends both legs at once; answer once the decode leg is in (bounded), so
            # what the decode leg carried is on the record before the refusal cancels it
            for _ in range(100):
                if self.decode_bodies:
                    break
                await asyncio.sleep(0.05)
            return JSONResponse(
                {"error": {"message": f"scripted {self.status}", "type": "x", "param": None, "code": self.status}},
                status_code=self.status,
            )

        return app

    def decode_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/ready")
        async def ready():
            return {"ready": True}

        @app.post("/v1/completions")
        async def completions(http: Request):
            self.decode_bodies.append(await http.json())
            await asyncio.sleep(60)  # waits for KV that never comes
            return {}

        return app


def serve(app: FastAPI, port: int) -> uvicorn.Server:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return server


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    s = Scripted()
    servers = [serve(s.prefill_app(), s.p_port), serve(s.decode_app(), s.d_port)]
    r_port = free_port()
    router = Proc(
        [
            "router",
            "--prefill",
            f"http://127.0.0.1:{s.p_port}",
            "--decode",
            f"http://127.0.0.1:{s.d_port}",
            "--port",
            r_port,
            "--health-interval",
            "0.5",
        ],
        tmp_path_factory.mktemp("leg") / "router.log",
    )
    try:
        router.wait_ready(f"http://127.0.0.1:{r_port}")
        s.url = f"http://127.0.0.1:{r_port}"
        yield s
    finally:
        router.stop()
        for srv in servers:
            srv.should_exit = True


def test_a_prefill_refusal_reaches_the_client_at_once(scripted):
    scripted.status = 400
    body = {"prompt": "hi", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    r = httpx.post(f"{scripted.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"] == "scripted 400"
    assert time.monotonic() - t0 < 20  # decode would hold it 60 s
    leg = scripted.prefill_bodies[-1]
    assert leg["stream"] is False and "stream_options" not in leg and isinstance(leg["bootstrap_room"], int)
    assert scripted.decode_bodies[-1]["stream"] is True and scripted.decode_bodies[-1]["stream_options"]


def test_a_prefill_failure_is_retried_then_answered_without_waiting_for_decode(scripted):
    scripted.status = 503
    n = len(scripted.prefill_bodies)
    t0 = time.monotonic()
    r = httpx.post(f"{scripted.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
    assert r.status_code >= 500 and "error" in json.loads(r.content)
    assert time.monotonic() - t0 < 20  # decode would hold it 60 s
    assert len(scripted.prefill_bodies) - n == 4  # the first send and --migration-limit (3) re-sends
