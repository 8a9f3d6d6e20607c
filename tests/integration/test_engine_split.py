"""`dsv4 serve` is two processes: the HTTP process and its engine core. Both show in
/debug/stacks; a dead core fails /health at once and ends requests in flight with an error
(then the HTTP process exits 1 for its supervisor); a dead HTTP process takes the core along."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import psutil

from bench.harness.commands import Proc, free_port


def _start(tiny_model, tmp_path, name: str) -> tuple[Proc, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = Proc(["serve", "--model", tiny_model, "--port", port, "--kv-pages", 256], tmp_path / f"{name}.log")
    proc.wait_ready(url)
    return proc, url


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_two_processes_and_both_stacks(tiny_model, tmp_path):
    proc, url = _start(tiny_model, tmp_path, "engine")
    try:
        info = httpx.get(f"{url}/server_info").json()
        assert info["pid"] == proc.popen.pid and info["engine_pid"] != info["pid"]
        assert psutil.Process(info["engine_pid"]).ppid() == info["pid"]
        stacks = httpx.get(f"{url}/debug/stacks").text
        http_part, core_part = stacks.split(f"=== engine core process (pid {info['engine_pid']}) ===")
        assert f"=== HTTP process (pid {info['pid']}) ===" in http_part and "dsv4-engine-channel" in http_part
        assert "thread dsv4-engine " in core_part  # the engine loop lives in the core, not here
        assert "thread dsv4-engine " not in http_part
    finally:
        proc.stop()


def test_dead_engine_core_fails_health_and_requests_in_flight(tiny_model, tmp_path):
    proc, url = _start(tiny_model, tmp_path, "engine")
    try:
        core = httpx.get(f"{url}/server_info").json()["engine_pid"]
        events: list = []
        first = threading.Event()

        def stream() -> None:
            body = {"prompt": "tell me", "max_tokens": 2000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(60)
        os.kill(core, signal.SIGKILL)
        t.join(30)
        assert not t.is_alive(), "the stream hung on a dead engine"
        assert events[-1] == "[DONE]" and "engine process exited" in json.loads(events[-2])["error"]["message"]
        r = httpx.get(f"{url}/health", timeout=5)
        assert r.status_code == 503 and "engine process exited" in r.json()["status"]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=5)
        assert r.status_code == 500 and r.json()["error"]["message"].startswith("request failed: engine process exited")
        assert proc.popen.wait(30) == 1  # then it exits for its supervisor to restart
    finally:
        proc.stop()


def test_engine_core_exits_with_its_http_process(tiny_model, tmp_path):
    proc, url = _start(tiny_model, tmp_path, "engine")
    try:
        core = psutil.Process(httpx.get(f"{url}/server_info").json()["engine_pid"])
        proc.popen.kill()
        proc.popen.wait(10)
        _wait(
            lambda: not core.is_running() or core.status() == psutil.STATUS_ZOMBIE,
            30,
            "the engine core outlived its HTTP process",
        )
    finally:
        proc.stop()


def test_sigterm_stops_both_processes_cleanly(tiny_model, tmp_path):
    """SIGTERM: drain, exit 0, the core gone too, and no traceback in the log (the channel reader
    used to schedule its last callback on the closed event loop: 'Event loop is closed')."""
    proc, url = _start(tiny_model, tmp_path, "engine")
    core = psutil.Process(httpx.get(f"{url}/server_info").json()["engine_pid"])
    assert httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=60).status_code == 200
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(30) == 0, proc.log()
    _wait(
        lambda: not core.is_running() or core.status() == psutil.STATUS_ZOMBIE, 30, "the engine core outlived SIGTERM"
    )
    proc.stop()
    assert "Traceback" not in proc.log_path.read_text(errors="replace"), proc.log_path.read_text(errors="replace")[
        -3000:
    ]


def test_flags_that_cannot_serve_are_refused_in_one_line(tiny_model):
    """Checked in the engine core before any weight is read: one line, exit 2 (not a start-up
    crash, not an engine that starts and then fails or never admits a request)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for flags, says in (
        (["--max-num-seqs", 0], "--max-num-seqs must be at least 1"),
        (["--max-num-batched-tokens", 0], "--max-num-batched-tokens must be at least 1"),
        (["--kernel-backend", "triton", "--device", "cpu"], "--kernel-backend triton needs a CUDA device"),
    ):
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "dsv4_cli",
                "serve",
                "--model",
                str(tiny_model),
                "--port",
                str(free_port()),
                *map(str, flags),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (flags, r.stdout, r.stderr)
        assert says in lines[0], lines[0]
