"""`dsv4 up --reconfigure` end to end, real processes: a flag change that carries the
stall_long_context fault passes no short request test but hangs the canary on the probe's
growing conversation, so it is reverted within the probe's bound while other traffic sees no
error; a harmless change passes the probe and is rolled to every engine."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from bench.harness.commands import Proc, free_port_block

pytestmark = pytest.mark.slow

# The request timeout is generous: two busy shared cores can take seconds for one round of the
# healthy engine; the stall is forever, so it is caught whatever the bound.
PROBE = [
    "--probe-duration",
    "8",
    "--probe-concurrency",
    "2",
    "--probe-growth-tokens",
    "40",
    "--probe-context-share",
    "0.25",
    "--probe-request-timeout",
    "10",
]
STALL_TOKENS = 100  # past the probe's first round (64 + 16 tokens), under its second (120)


def reconfigure(port: int, env: dict, *engine_args: str) -> tuple[int, dict, float]:
    started = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsv4_cli",
            "up",
            "--port",
            str(port),
            "--reconfigure",
            *PROBE,
            *(f"--engine-arg={a}" for a in engine_args),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
    )
    assert out.stdout.strip(), out.stderr
    return out.returncode, json.loads(out.stdout), time.monotonic() - started


class Traffic:
    """Short completions through the router, one after another, counting answers and errors."""

    def __init__(self, url: str):
        self.url, self.ok, self.errors, self.stop = url, 0, [], threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                r = httpx.post(
                    f"{self.url}/v1/completions",
                    json={"prompt": "hi there", "max_tokens": 8, "temperature": 0},
                    timeout=60,
                )
                if r.status_code == 200:
                    self.ok += 1
                else:
                    self.errors.append(f"{r.status_code} {r.text[:200]}")
            except httpx.HTTPError as e:
                self.errors.append(repr(e))
            time.sleep(0.1)

    def end(self) -> None:
        self.stop.set()
        self.thread.join(70)


def test_reconfigure_reverts_a_stalling_change_and_keeps_a_harmless_one(tmp_path, tiny_model):
    import os

    port = free_port_block()
    env = {**os.environ, "DSV4_CACHE": str(tmp_path / "cache")}
    up = Proc(
        [
            "up",
            "--model",
            tiny_model,
            "--port",
            port,
            "--decode",
            2,
            "--scrape-interval",
            0.5,
            "--evidence-dir",
            tmp_path / "evidence",
        ],
        tmp_path / "up.log",
        env={"DSV4_CACHE": str(tmp_path / "cache")},
    )
    url = f"http://127.0.0.1:{port}"
    state = tmp_path / "cache" / "up" / str(port)
    try:
        up.wait_ready(url, timeout=120)
        deadline = time.monotonic() + 60
        while "admin token:" not in up.log():
            assert time.monotonic() < deadline, up.log()
            time.sleep(0.2)
        traffic = Traffic(url)
        rc, bad, took = reconfigure(
            port, env, "--enable-fault-injection", f"--arm-fault=stall_long_context:tokens={STALL_TOKENS}"
        )
        assert rc == 1 and bad["kept"] is False, bad
        reasons = " ".join(bad["verdict"]["reasons"])
        assert "no answer within the request timeout" in reasons or "reached" in reasons, reasons
        assert bad["verdict"]["stable"]["max_context"] > STALL_TOKENS, bad  # the old revision carried it further
        assert Path(bad["evidence"], "verdict.json").exists()
        # The canary's probe is bounded: duration + request timeout + settle (10 s) + scheduling slack;
        # the restarts around it take what an engine start takes on this machine.
        assert bad["phases_s"]["canary_probe"] < 8 + 10 + 10 + 10, bad["phases_s"]
        assert bad["verdict"]["canary"]["stalled"] > 0 or bad["verdict"]["canary"]["errors"] > 0
        procs = json.loads((state / "processes.json").read_text())
        assert procs["decode-0"]["running"]
        time.sleep(2)
        traffic.end()
        assert traffic.errors == [] and traffic.ok > 5, (traffic.errors, traffic.ok)
        cmdline = Path(f"/proc/{procs['decode-0']['pid']}/cmdline").read_bytes().split(b"\0")
        assert b"--enable-fault-injection" not in cmdline  # back on the old flags

        rc, good, took = reconfigure(port, env, "--max-num-seqs=32")
        assert rc == 0 and good["kept"] is True, (good, up.log())
        assert good["verdict"]["passed"]
        procs = json.loads((state / "processes.json").read_text())
        for key in ("prefill-0", "decode-0", "decode-1"):
            cmdline = Path(f"/proc/{procs[key]['pid']}/cmdline").read_bytes().split(b"\0")
            assert b"--max-num-seqs=32" in cmdline, key
        assert (
            httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60).status_code == 200
        )
        (tmp_path / "reconfigure.json").write_text(json.dumps({"bad": bad, "good": good}, indent=1))
    finally:
        up.stop()
