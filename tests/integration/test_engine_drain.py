"""SIGTERM drains a real `dsv4 serve`: it stops taking requests (503 with an OpenAI body, /ready
503 "draining"), lets running requests finish for --shutdown-grace seconds, ends the rest with
an error (an SSE error event then [DONE] for streams, a 503 otherwise) and exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from bench.harness.commands import Proc, free_port

GRACE = 3.0


def stream_events(url: str, body: dict, first: threading.Event, out: list) -> None:
    with httpx.Client(base_url=url, timeout=120) as c:
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            out.append(r.status_code)
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    out.append(data if data == "[DONE]" else json.loads(data))
                    first.set()
    first.set()


def test_sigterm_drains_running_requests_then_exits_zero(tiny_model, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = Proc(
        ["serve", "--model", tiny_model, "--port", port, "--kv-pages", 512, "--shutdown-grace", GRACE],
        tmp_path / "engine.log",
    )
    try:
        proc.wait_ready(url)
        long_stream, long_first = [], threading.Event()
        short_stream, short_first = [], threading.Event()
        long_plain: dict = {}
        long_body = {"prompt": "a long story", "max_tokens": 1900, "ignore_eos": True}

        def plain():
            with httpx.Client(base_url=url, timeout=120) as c:
                long_plain["r"] = c.post("/v1/completions", json=long_body)

        threads = [
            threading.Thread(target=stream_events, args=(url, long_body, long_first, long_stream)),
            threading.Thread(target=plain),
        ]
        for t in threads:
            t.start()
        assert long_first.wait(60)
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/v1/loads").json()["queues"]["running"] < 2:
            assert time.monotonic() < deadline, "the long requests never ran"
            time.sleep(0.02)
        short = threading.Thread(
            target=stream_events,
            args=(url, {"prompt": "short", "max_tokens": 20, "ignore_eos": True}, short_first, short_stream),
        )
        short.start()
        assert short_first.wait(60)

        proc.popen.send_signal(signal.SIGTERM)
        sigterm_at = time.monotonic()
        # Draining: not ready, new requests refused with an OpenAI body, still alive.
        deadline = time.monotonic() + 10
        while (r := httpx.get(f"{url}/ready")).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert r.json()["reason"] == "draining"
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "new", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert httpx.get(f"{url}/health").status_code == 200

        # The short request, running when SIGTERM came, finished normally within the grace.
        short.join(60)
        assert short_stream[0] == 200 and short_stream[-1] == "[DONE]"
        assert short_stream[-2]["choices"][0]["finish_reason"] == "length"

        # The long ones ran through the grace, then were ended with an error.
        for t in threads:
            t.join(60)
        ended_after = time.monotonic() - sigterm_at
        assert ended_after >= GRACE - 0.5, ended_after
        assert long_stream[-1] == "[DONE]"
        err = long_stream[-2]["error"]
        assert "shutting down" in err["message"] and err["code"] == 503
        assert all(e["choices"][0]["finish_reason"] is None for e in long_stream[1:-2])
        r = long_plain["r"]
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]

        assert proc.popen.wait(30) == 0, proc.log()
        assert time.monotonic() - sigterm_at < GRACE + 20
    finally:
        proc.stop()
