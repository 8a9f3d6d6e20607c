"""`dsv4 serve --tp-size 2` at its edges, as real processes: a checkpoint whose broken tensor
only rank 1 would read is refused in one line before any rank starts, and a rank that hangs
while it loads its weights (alive, so the watchdog's poll does not see it) fails the start
within the step timeout instead of holding it forever."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from bench.harness.commands import Proc, free_port

sys.path.insert(0, str(Path(__file__).parent))
from test_tp import ranks_of  # noqa: E402

ARGS = ["--kv-pages", 64, "--device", "cpu"]


@pytest.fixture(scope="module")
def v4_fp8(tmp_path_factory) -> Path:
    from dsv4_engine.checkpoint import init_checkpoint

    return init_checkpoint(tmp_path_factory.mktemp("tpq") / "v4-tiny-fp8", preset="v4-tiny", quant="fp8")


def test_a_broken_tensor_of_rank_1s_experts_is_refused_in_one_line_before_any_rank_starts(v4_fp8, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(v4_fp8, bad)
    w = load_file(str(bad / "model.safetensors"))
    del w["layers.2.ffn.experts.3.w2.scale"]  # expert 3 of 4: rank 1's at --tp-size 2
    save_file(w, str(bad / "model.safetensors"), metadata={"format": "pt"})
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsv4_cli",
            "serve",
            "--model",
            str(bad),
            *map(str, ARGS),
            "--tp-size",
            "2",
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = (r.stdout + r.stderr).strip()
    assert r.returncode == 2, out
    assert out.count("\n") == 0 and "layers.2.ffn.experts.3.w2.weight is fp8" in out and "no scales" in out, out


def test_a_load_failure_on_rank_1_alone_is_named_in_the_engines_last_line(tmp_path):
    """What the headers cannot show (here fp4 scales that are no powers of two, on an expert only
    rank 1 holds) fails rank 1 alone: the start fails naming rank 1's reason and the checkpoint's
    tensor name, not the collective's 'connection closed by peer' that follows it."""
    import torch

    from dsv4_engine.checkpoint import init_checkpoint

    bad = init_checkpoint(tmp_path / "fp4", preset="v4-tiny", quant="fp4-experts")
    w = load_file(str(bad / "model.safetensors"))
    w["layers.2.ffn.experts.3.w1.scale"] = torch.full(w["layers.2.ffn.experts.3.w1.scale"].shape, 0.3)
    save_file(w, str(bad / "model.safetensors"), metadata={"format": "pt"})
    started = time.monotonic()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsv4_cli",
            "serve",
            "--model",
            str(bad),
            *map(str, ARGS),
            "--tp-size",
            "2",
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    last = (r.stdout + r.stderr).strip().splitlines()[-1]
    assert r.returncode != 0 and time.monotonic() - started < 60
    assert "rank 1" in last and "layers.2.ffn.experts.3.w1.weight: fp4 scales must be powers of two" in last, last


def _loading(pid: int) -> bool:
    try:
        return "model.safetensors" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def test_a_rank_that_hangs_while_loading_fails_the_start(mla512_model, tmp_path):
    proc = Proc(
        ["serve", "--model", mla512_model, *ARGS, "--tp-size", 2, "--port", free_port()],
        tmp_path / "serve.log",
        env={"DSV4_TP_TIMEOUT_S": "3"},
    )
    rank1 = None
    try:
        deadline = time.monotonic() + 90
        while rank1 is None or not _loading(rank1):
            assert time.monotonic() < deadline and proc.popen.poll() is None, proc.log()
            found = ranks_of(proc.popen.pid)
            rank1 = found[0] if found else None
            time.sleep(0.005)
        os.kill(rank1, signal.SIGSTOP)  # joined the group, reading its shard: alive but stuck
        stopped = time.monotonic()
        code = proc.popen.wait(timeout=30)
        took = time.monotonic() - stopped
        assert code != 0, proc.log()
        assert "gave no sign of life" in proc.log() and "a rank is hung" in proc.log(), proc.log()
        print(f"rank 1 hung while loading: dsv4 serve exited {code} {took:.1f} s after SIGSTOP (step timeout 3 s)")
    finally:
        if rank1 is not None and Path(f"/proc/{rank1}").exists():
            os.kill(rank1, signal.SIGKILL)
        proc.stop()


BODIES = [
    {
        "prompt": "the quick brown fox jumps over the lazy dog " * 3,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    },
    {
        "prompt": "once upon a time there was a model",
        "max_tokens": 16,
        "temperature": 0.8,
        "seed": 7,
        "ignore_eos": True,
        "stream": True,
    },
    {
        "prompt": "hello world and more words to read",
        "max_tokens": 12,
        "temperature": 0.5,
        "seed": 3,
        "logprobs": 2,
        "ignore_eos": True,
    },
    {"prompt": "a b c d e f g h i j k l m n o p q r s t", "max_tokens": 16, "temperature": 0, "ignore_eos": True},
    {
        "prompt": "the quick brown fox jumps over the lazy dog " * 3,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
    },  # the first prompt again: a prefix-cache hit on V3
]


async def _completion(c, body: dict):
    import json

    body = {"model": "m", **body}
    if not body.get("stream"):
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        return ch["text"], ch.get("logprobs") and [round(x, 3) for x in ch["logprobs"]["token_logprobs"]]
    text = ""
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


async def _walk_away(c):
    """A streamed request whose client leaves after its first chunk: the engine aborts it."""
    body = {"model": "m", "prompt": "leave early", "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                return


@pytest.mark.slow  # ~10 s a preset (two servers); the engine-level twin in tests/unit/parallel runs by default
@pytest.mark.parametrize("preset", ["v4-tiny", "mla512"])
def test_tp2_serves_concurrent_mixed_requests_as_tp1_over_http(make_model, tmp_path, preset):
    """Concurrent streamed and plain requests (greedy, seeded, logprobs, a repeated prompt), one
    client that walks away, a pool small enough to preempt: tp 2 answers what tp 1 does, every
    page comes back, and /v1/loads shows the world size."""
    import asyncio

    import httpx

    from bench.harness.commands import serving

    async def run(url):
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            got = await asyncio.gather(*[_completion(c, b) for b in BODIES], _walk_away(c))
            deadline = time.monotonic() + 30
            while True:  # the walked-away request is aborted on the engine's next step
                loads = (await c.get("/v1/loads")).json()
                if loads["kv_pages_free"] == loads["kv_pages_total"] or time.monotonic() > deadline:
                    return got[:-1], loads
                await asyncio.sleep(0.1)

    out = {}
    for tp in (1, 2):
        args = [
            "--model",
            make_model(preset),
            "--kv-pages",
            16,
            "--page-size",
            8,
            "--served-model-name",
            "m",
            "--device",
            "cpu",
            "--tp-size",
            tp,
        ]
        with serving(args, tmp_path / f"tp{tp}.log") as url:
            out[tp] = asyncio.run(run(url))
    (ref, loads1), (got, loads2) = out[1], out[2]
    assert got == ref
    assert loads2["tp_size"] == 2 and loads1["tp_size"] == 1
    assert loads2["kv_pages_free"] == loads2["kv_pages_total"], loads2


def test_an_idle_engine_notices_a_stopped_rank_by_its_heartbeat(tiny_model, tmp_path):
    """No request running, so no step times out: the stopped rank's heartbeat goes stale,
    /health stops answering 200 and the engine exits non-zero within the timeout + the grace."""
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = Proc(
        ["serve", "--model", tiny_model, *ARGS, "--tp-size", 2, "--port", port],
        tmp_path / "idle.log",
        env={"DSV4_TP_TIMEOUT_S": "3"},
    )
    rank1 = None
    try:
        proc.wait_ready(url)
        (rank1,) = ranks_of(proc.popen.pid)
        os.kill(rank1, signal.SIGSTOP)
        stopped = time.monotonic()
        unhealthy = None
        while proc.popen.poll() is None and time.monotonic() - stopped < 30:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code != 200 and unhealthy is None:
                    unhealthy = time.monotonic() - stopped
            except httpx.HTTPError:
                unhealthy = unhealthy or time.monotonic() - stopped
            time.sleep(0.1)
        code = proc.popen.wait(timeout=15)
        took = time.monotonic() - stopped
        assert code != 0 and unhealthy is not None, proc.log()
        assert "gave no sign of life" in proc.log(), proc.log()
        print(f"idle engine, rank 1 stopped: /health failed after {unhealthy:.1f} s, exit {code} after {took:.1f} s")
    finally:
        if rank1 is not None and Path(f"/proc/{rank1}").exists():
            os.kill(rank1, signal.SIGKILL)
        proc.stop()
