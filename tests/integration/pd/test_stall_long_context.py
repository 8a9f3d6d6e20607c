"""stall_long_context over real processes: a decode engine started with `--arm-fault` serves a
short request and hangs on a long one (its loop stops: the watchdog's wedge signal) until the
fault is cleared over /admin/faults; arming it over HTTP works the same."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import pytest

from bench.harness.commands import Proc, free_port, stop_all

THRESHOLD = 60


@pytest.fixture(scope="module")
def pd(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stall")
    p_port, b_port, d_port, r_port = (free_port() for _ in range(4))
    common = [
        "serve",
        "--model",
        tiny_model,
        "--kv-pages",
        128,
        "--page-size",
        16,
        "--enable-fault-injection",
        "--served-model-name",
        "m",
    ]
    procs = [
        Proc([*common, "--role", "prefill", "--port", p_port, "--bootstrap-port", b_port], tmp / "p.log"),
        Proc(
            [*common, "--role", "decode", "--port", d_port, "--arm-fault", f"stall_long_context:tokens={THRESHOLD}"],
            tmp / "d.log",
        ),
    ]
    urls = [f"http://127.0.0.1:{p}" for p in (p_port, d_port, r_port)]
    procs.append(
        Proc(
            ["router", "--prefill", urls[0], "--decode", urls[1], "--port", r_port, "--health-interval", "0.5"],
            tmp / "r.log",
        )
    )
    try:
        for proc, url in zip(procs, urls):
            proc.wait_ready(url)
        yield urls
    finally:
        stop_all(procs)


def _complete(url, n_prompt, timeout, max_tokens=8):
    return httpx.post(
        f"{url}/v1/completions",
        json={"prompt": list(range(2, 2 + n_prompt)), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        timeout=timeout,
    )


def test_short_passes_long_hangs_until_cleared(pd):
    _, d_url, r_url = pd
    assert httpx.get(f"{d_url}/admin/faults", timeout=5).json()["armed"]["stall_long_context"]["tokens"] == THRESHOLD
    assert _complete(r_url, 20, timeout=60).status_code == 200  # 20 + 8 tokens: under the threshold
    got: dict = {}

    def long():
        started = time.monotonic()
        got["r"] = _complete(r_url, THRESHOLD + 5, timeout=60)
        got["s"] = time.monotonic() - started

    t = threading.Thread(target=long)
    t.start()
    t.join(3.0)
    assert t.is_alive(), "the long request should hang while the fault is armed"
    assert httpx.delete(f"{d_url}/admin/faults", timeout=5).status_code == 200
    t.join(60)
    assert got["r"].status_code == 200 and got["s"] >= 3.0
    assert got["r"].json()["usage"]["completion_tokens"] == 8
    assert _complete(r_url, THRESHOLD + 5, timeout=60).status_code == 200  # cleared: long passes


def test_armed_over_http_with_seconds(pd):
    _, d_url, r_url = pd
    r = httpx.post(
        f"{d_url}/admin/faults",
        json={"fault": "stall_long_context", "count": 1, "tokens": 30, "seconds": 1.5},
        timeout=5,
    )
    assert r.status_code == 200, r.text
    started = time.monotonic()
    assert _complete(r_url, 40, timeout=60).status_code == 200
    assert time.monotonic() - started >= 1.5  # one step hung for its seconds, then went on
    assert "stall_long_context" not in httpx.get(f"{d_url}/admin/faults", timeout=5).json()["armed"]


@pytest.mark.parametrize(
    "extra,says",
    [([], "--enable-fault-injection"), (["--enable-fault-injection", "--role", "decode"], "unknown fault")],
)
def test_arm_fault_refused_before_start(tiny_model, extra, says):
    name = "stall_long_context" if not extra else "stall_everything"
    out = subprocess.run(
        [sys.executable, "-m", "dsv4_cli", "serve", "--model", str(tiny_model), "--arm-fault", name, *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and says in out.stderr + out.stdout
