"""`dsv4 serve --tp-size 2` as a real process (rank 1 its child, gloo on 127.0.0.1): the same
greedy text as `--tp-size 1` over HTTP, and a rank that dies takes the engine down loudly —
clients get an error, not a hang, /health stops answering 200, the process exits non-zero."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from bench.harness.commands import Proc, free_port, serving_all

BODY = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
# From a rank's death to the process gone: the watchdog's poll (0.2 s) + FAIL_GRACE_S (2 s),
# with room for a loaded CI machine.
DOWN_WITHIN_S = 15.0


def children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def ranks_of(pid: int) -> list[int]:
    """The rank processes under `dsv4 serve` (children of its engine core process)."""
    found, todo = [], [pid]
    while todo:
        for k in children(todo.pop()):
            try:
                cmd = Path(f"/proc/{k}/cmdline").read_bytes()
            except OSError:
                continue
            (found if b"dsv4_engine.parallel.worker" in cmd else todo).append(k)
    return found


def completion(url: str, stream: bool = False) -> str:
    with httpx.Client(base_url=url, timeout=120) as c:
        if not stream:
            r = c.post("/v1/completions", json=BODY)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        text = ""
        with c.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    import json

                    text += json.loads(line[6:])["choices"][0]["text"]
        return text


ARGS = ["--kv-pages", 128, "--served-model-name", "tiny", "--device", "cpu"]


def test_tp2_serves_the_same_text_as_tp1(tiny_model, tmp_path):
    with serving_all(
        [
            (["--model", tiny_model, *ARGS], tmp_path / "tp1.log"),
            (["--model", tiny_model, *ARGS, "--tp-size", 2], tmp_path / "tp2.log"),
        ]
    ) as (tp1, url):
        ref = completion(tp1)
        assert completion(url) == ref and completion(url, stream=True) == ref
        loads = httpx.get(f"{url}/v1/loads").json()
        assert loads["tp_size"] == 2 and loads["kv_pages_total"] == 128
        metrics = httpx.get(f"{url}/metrics").text
        assert any(ln.startswith("dsv4:tp_size{") and ln.endswith(" 2.0") for ln in metrics.splitlines()), metrics[
            :2000
        ]
    assert ref


def test_a_rank_that_dies_takes_the_engine_down_loudly(tiny_model, tmp_path):
    port = free_port()
    proc = Proc(["serve", "--model", tiny_model, *ARGS, "--tp-size", 2, "--port", port], tmp_path / "tp.log")
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_ready(url)
        (rank1,) = ranks_of(proc.popen.pid)
        with httpx.Client(base_url=url, timeout=httpx.Timeout(DOWN_WITHIN_S)) as c:
            with c.stream("POST", "/v1/completions", json={**BODY, "max_tokens": 1500, "stream": True}) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data: {"))  # generating
                os.kill(rank1, signal.SIGKILL)
                killed = time.monotonic()
                rest = []
                try:
                    for line in lines:
                        rest.append(line)
                except httpx.HTTPError:
                    pass  # the connection closing under us is an error the client sees too
                ended = time.monotonic() - killed
            assert ended < DOWN_WITHIN_S
            finished = [line for line in rest if '"finish_reason":"length"' in line.replace(" ", "")]
            assert not finished, "the request must not end as if it had completed"
            # New requests and /health fail too (an error answer or no answer), they do not hang.
            try:
                assert c.get("/health", timeout=5).status_code != 200
            except httpx.HTTPError:
                pass
        code = proc.popen.wait(timeout=DOWN_WITHIN_S)
        print(f"stream ended {ended:.2f} s after the kill, process exited {time.monotonic() - killed:.2f} s after")
        assert code != 0, proc.log()
        log = (tmp_path / "tp.log").read_text(errors="replace")
        assert "tensor-parallel group failed" in log, log[-3000:]
    finally:
        proc.stop()


def test_an_idle_engine_notices_a_dead_rank_and_rank_1_outlives_no_rank_0(tiny_model, tmp_path):
    """The watchdog path (no request running, so no collective fails first): rank 1 killed ->
    rank 0 exits non-zero. And a rank 1 whose rank 0 is killed exits on its own."""
    port = free_port()
    proc = Proc(["serve", "--model", tiny_model, *ARGS, "--tp-size", 2, "--port", port], tmp_path / "a.log")
    try:
        proc.wait_ready(f"http://127.0.0.1:{port}")
        (rank1,) = ranks_of(proc.popen.pid)
        os.kill(rank1, signal.SIGKILL)
        assert proc.popen.wait(timeout=DOWN_WITHIN_S) != 0
        assert f"rank 1 (pid {rank1}) exited with code -9" in (tmp_path / "a.log").read_text(errors="replace")
    finally:
        proc.stop()
    port = free_port()
    proc = Proc(["serve", "--model", tiny_model, *ARGS, "--tp-size", 2, "--port", port], tmp_path / "b.log")
    try:
        proc.wait_ready(f"http://127.0.0.1:{port}")
        (rank1,) = ranks_of(proc.popen.pid)
        proc.popen.kill()
        proc.popen.wait()
        deadline = time.monotonic() + DOWN_WITHIN_S
        while Path(f"/proc/{rank1}").exists() and b"parallel.worker" in Path(f"/proc/{rank1}/cmdline").read_bytes():
            assert time.monotonic() < deadline, "rank 1 outlived rank 0"
            time.sleep(0.1)
    finally:
        proc.stop()


def test_a_tp_size_the_model_cannot_split_is_refused_in_one_line(tiny_model):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "dsv4_cli", "serve", "--model", str(tiny_model), "--tp-size", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert "--tp-size 3 does not divide num_attention_heads (8)" in r.stderr + r.stdout


@pytest.mark.slow  # the supervisor's restart of a dead engine is covered by test_up; this is the tp end to end
def test_dsv4_up_restarts_an_engine_whose_rank_died(tiny_model, tmp_path):
    """`dsv4 up --mono --tp-size 2`: rank 1 killed -> the engine exits 1 -> the supervisor
    restarts it like any dead engine, and the router serves again."""
    import json

    from bench.harness.commands import free_port_block

    port = free_port_block()
    up = Proc(
        ["up", "--mono", "--model", tiny_model, "--port", port, "--tp-size", 2, "--no-deadlines", "--no-watchdog"],
        tmp_path / "up.log",
        env={"DSV4_CACHE": str(tmp_path / "cache"), "COLUMNS": "80"},
    )
    url = f"http://127.0.0.1:{port}"
    state = tmp_path / "cache" / "up" / str(port)
    body = {"prompt": "after the storm", "max_tokens": 4, "ignore_eos": True, "temperature": 0}

    def serves(timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
                if r.status_code == 200:
                    return r.json()
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, up.log()
            time.sleep(0.5)

    try:
        up.wait_ready(url, timeout=180)
        first = serves(120)
        engine = json.loads((state / "processes.json").read_text())["mono-0"]
        (rank1,) = ranks_of(engine["pid"])
        os.kill(rank1, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:
            info = json.loads((state / "processes.json").read_text())["mono-0"]
            if info["pid"] != engine["pid"] and info.get("restarts") == 1:
                break
            assert time.monotonic() < deadline, up.log()
            time.sleep(0.2)
        assert info["last_exit"] == 1
        assert serves(120)["choices"][0]["text"] == first["choices"][0]["text"]
        assert len(ranks_of(info["pid"])) == 1  # the new engine has its rank 1 again
    finally:
        up.stop()


def test_a_hung_rank_fails_the_engine_when_its_collective_times_out(tiny_model, tmp_path):
    """A rank that stops answering (SIGSTOP) without exiting: the watchdog sees a live process,
    so the collective's timeout (DSV4_TP_TIMEOUT_S, 3 s here) is what ends the wait."""
    port = free_port()
    proc = Proc(
        ["serve", "--model", tiny_model, *ARGS, "--tp-size", 2, "--port", port],
        tmp_path / "hung.log",
        env={"DSV4_TP_TIMEOUT_S": "3"},
    )
    url = f"http://127.0.0.1:{port}"
    rank1 = None
    try:
        proc.wait_ready(url)
        (rank1,) = ranks_of(proc.popen.pid)
        os.kill(rank1, signal.SIGSTOP)
        started = time.monotonic()
        try:
            r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=DOWN_WITHIN_S + 3)
            assert r.status_code >= 500, r.text
        except httpx.HTTPError:
            pass  # the process went down under the request: an error too
        took = time.monotonic() - started
        assert took < DOWN_WITHIN_S + 3, proc.log()
        assert proc.popen.wait(timeout=DOWN_WITHIN_S) != 0, proc.log()
        log = (tmp_path / "hung.log").read_text(errors="replace")
        assert "tensor-parallel group failed" in log and "a rank is hung" in log, log[-3000:]
        print(f"hung rank: the request failed {took:.2f} s after SIGSTOP (step timeout 3 s)")
    finally:
        if rank1 is not None and Path(f"/proc/{rank1}").exists():
            os.kill(rank1, signal.SIGKILL)
        proc.stop()
