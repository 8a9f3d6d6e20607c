"""Planned disruptions cost latency, not errors (issue 45), as a new user would meet them:
`dsv4 up` with one prefill and one decode, streaming clients (the official `openai` client)
while `dsv4 up --reconfigure` rolls both engines, the only one of each role. Before: the
engine being restarted drained and answered every new request 503 `shutting_down`, the router
kept sending to it and a client got a 503 once its re-sends were spent. Now the new engine is
started and routed to before the old one drains (surge), and a draining engine is out of the
router at its first refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import openai
import pytest

from bench.harness.commands import Proc, free_port_block

pytestmark = pytest.mark.slow  # ~60 s: dsv4 up, a canary probe and two engine starts


class Streams:
    """`n` clients streaming completions back to back: answers, errors; one holds long streams
    (an engine's drain lasts as long as they do)."""

    def __init__(self, url: str, model: str, n: int, long_tokens: int):
        self.url, self.model, self.ok, self.errors, self.stop = url, model, 0, [], threading.Event()
        self.threads = [
            threading.Thread(target=self.run, args=(long_tokens if i == 0 else 12,), daemon=True) for i in range(n)
        ]
        for t in self.threads:
            t.start()

    def run(self, max_tokens: int) -> None:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120)
        while not self.stop.is_set():
            try:
                stream = client.completions.create(
                    model=self.model,
                    prompt="the weather today is",
                    max_tokens=max_tokens,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                text = "".join(c.choices[0].text for c in stream if c.choices)
                assert text, "an empty answer"
                self.ok += 1
            except Exception as e:  # noqa: BLE001  every failure is what the test counts
                self.errors.append(f"{type(e).__name__}: {str(e)[:200]}")

    def end(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(150)


def test_rolling_the_only_prefill_and_decode_costs_no_client_error(tmp_path, tiny_model):
    port = free_port_block()
    cache = {"DSV4_CACHE": str(tmp_path / "cache")}
    up = Proc(["up", "--model", tiny_model, "--port", port, "--scrape-interval", 0.5], tmp_path / "up.log", env=cache)
    url = f"http://127.0.0.1:{port}"
    state = tmp_path / "cache" / "up" / str(port)
    try:
        up.wait_ready(url, timeout=120)
        deadline = time.monotonic() + 60
        while "admin token:" not in up.log():
            assert time.monotonic() < deadline, up.log()
            time.sleep(0.2)
        before = json.loads((state / "processes.json").read_text())
        streams = Streams(url, tiny_model.name, 3, long_tokens=160)
        time.sleep(2)
        out = subprocess.run(
            [sys.executable, "-m", "dsv4_cli", "up", "--port", str(port), "--reconfigure"]
            + ["--probe-duration", "3", "--probe-concurrency", "1", "--engine-arg=--max-num-seqs=32"],
            capture_output=True,
            text=True,
            timeout=400,
            env={**os.environ, **cache},
        )
        time.sleep(1)
        streams.end()
        assert streams.errors == [], (len(streams.errors), streams.errors[:5], streams.ok)
        result = json.loads(out.stdout)
        assert out.returncode == 0 and result["kept"] is True, (out.stdout, out.stderr, up.log())
        assert streams.ok > 10, streams.ok
        after = json.loads((state / "processes.json").read_text())
        for key in ("prefill-0", "decode-0"):  # both replaced by new processes on new ports, on the new flags
            assert after[key]["port"] != before[key]["port"], (before, after)
            cmdline = open(f"/proc/{after[key]['pid']}/cmdline", "rb").read().split(b"\0")
            assert b"--max-num-seqs=32" in cmdline, key
    finally:
        up.stop()
