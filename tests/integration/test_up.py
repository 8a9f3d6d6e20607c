"""`dsv4 up` end to end on one machine: a reproduced wedge is detected and healed by the local
watchdog; with the engine's own deadlines on, the engine heals itself and nothing is touched; a
crashed process is restarted by the supervisor, not remediated; every admin call needs the
token `dsv4 up` generated, and its own calls carry it."""

from __future__ import annotations

import json
import os
import signal
import stat
import threading
import time
from pathlib import Path

import httpx

from bench.harness.commands import Proc, free_port_block

WINDOW = 4.0
CRASH_RESTART_BOUND_S = (
    60.0  # kill -9 -> ready again: measured 6.5-12.3 s (engine), 0.8-2.9 s (router) on 2 shared cores
)


class Up:
    def __init__(self, proc: Proc, url: str, evidence: Path, state: Path):
        self.proc, self.url, self.evidence, self.state = proc, url, evidence, state

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {(self.state / 'admin-token').read_text().strip()}"}

    def processes(self) -> dict[str, dict]:
        return json.loads((self.state / "processes.json").read_text())

    def status(self) -> dict:
        try:
            return json.loads((self.state / "status.json").read_text())
        except (OSError, ValueError):  # not written yet, or caught mid-write
            return {}


def start_up(tmp: Path, model: Path, *extra: str) -> Up:
    port = free_port_block()
    evidence = tmp / "evidence"
    # COLUMNS=80: the startup lines must not break the (long) pytest paths.
    proc = Proc(
        [
            "up",
            "--model",
            model,
            "--port",
            port,
            "--enable-fault-injection",
            "--detection-window",
            WINDOW,
            "--scrape-interval",
            0.5,
            "--evidence-dir",
            evidence,
            *extra,
        ],
        tmp / "up.log",
        env={"DSV4_CACHE": str(tmp / "cache"), "COLUMNS": "80"},
    )
    url = f"http://127.0.0.1:{port}"
    proc.wait_ready(url, timeout=120)
    up = Up(proc, url, evidence, tmp / "cache" / "up" / str(port))
    deadline = time.monotonic() + 30
    while "admin token:" not in proc.log():  # printed once every engine is ready too
        assert time.monotonic() < deadline, proc.log()
        time.sleep(0.2)
    return up


def workers(up: Up) -> dict[str, dict]:
    return {w["role"]: w for w in httpx.get(f"{up.url}/admin/workers", headers=up.admin).json()["workers"]}


def complete_eventually(url: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.post(
            f"{url}/v1/completions", json={"prompt": "after the storm", "max_tokens": 4, "ignore_eos": True}, timeout=30
        )
        if r.status_code == 200:
            return r.json()
        assert time.monotonic() < deadline, r.text
        time.sleep(0.5)


def wedge_request(url: str) -> threading.Thread:
    t = threading.Thread(
        target=lambda: httpx.post(f"{url}/v1/completions", json={"prompt": "stuck", "max_tokens": 4}, timeout=120),
        daemon=True,
    )
    t.start()
    return t


def check_security(up: Up) -> None:
    """The generated secrets: on disk 0600 in a 0700 folder, named but never printed, out of
    every process's argv; admin endpoints refuse without the token and accept with it."""
    token = up.admin["Authorization"].removeprefix("Bearer ")
    assert stat.S_IMODE(up.state.stat().st_mode) == 0o700
    for name in ("admin-token", "pd-secret"):
        assert stat.S_IMODE((up.state / name).stat().st_mode) == 0o600
    log = up.proc.log()
    assert f"admin token: {up.state / 'admin-token'}" in log, log  # whole, at 80 columns
    assert token not in log and (up.state / "pd-secret").read_text().strip() not in log
    for info in up.processes().values():
        argv = Path(f"/proc/{info['pid']}/cmdline").read_bytes().decode(errors="replace")
        assert token not in argv and "DSV4_ADMIN_TOKEN" not in argv
    engine = workers(up)["decode"]["url"]
    for method, url in (
        ("GET", up.url + "/admin/workers"),
        ("POST", up.url + "/admin/workers"),
        ("DELETE", up.url + "/admin/workers"),
        ("GET", engine + "/debug/stacks"),
        ("POST", engine + "/admin/drain"),
        ("POST", engine + "/admin/abort"),
        ("GET", engine + "/admin/faults"),
    ):
        r = httpx.request(method, url, json={"url": "http://127.0.0.1:1", "role": "decode"})
        assert r.status_code == 401, (method, url, r.status_code, r.text)
        r = httpx.request(method, url, headers={"Authorization": "Bearer not-the-token"}, json={})
        assert r.status_code == 401, (method, url, r.status_code)
    assert httpx.get(up.url + "/admin/workers", headers=up.admin).status_code == 200
    assert "thread" in httpx.get(engine + "/debug/stacks", headers=up.admin).text


def test_up_heals_a_reproduced_wedge(tmp_path, tiny_model):
    up = start_up(tmp_path, tiny_model, "--no-deadlines")
    url, evidence, proc = up.url, up.evidence, up.proc
    try:
        check_security(up)
        assert complete_eventually(url)["usage"]["completion_tokens"] == 4
        prefill = workers(up)["prefill"]["url"]
        old_pid = httpx.get(f"{prefill}/server_info").json()["boot_id"]
        httpx.post(
            f"{prefill}/admin/faults", json={"fault": "stall_transfer", "count": 1}, headers=up.admin
        ).raise_for_status()
        t = wedge_request(url)
        deadline = time.monotonic() + WINDOW + 30
        while not any(p.name.startswith("local-evidence-prefill") for p in evidence.glob("*")):
            assert time.monotonic() < deadline, proc.log()
            time.sleep(0.3)
        folder = next(p for p in evidence.glob("local-evidence-prefill*"))
        verdict = json.loads((folder / "verdict.json").read_text())
        assert verdict["state"] == "Wedged" and verdict["reason"] == "stuck_inflight"
        # /debug/stacks answered the watchdog: its call carried the admin token.
        assert "dsv4-engine" in (folder / "stacks.txt").read_text()
        assert json.loads((folder / "loads.json").read_text())["queues"]["inflight"] == 1
        # the stuck request's timeline: it got as far as the transfer, and has not moved since
        [stuck, *_] = json.loads((folder / "timelines.json").read_text())
        assert stuck["state"] == "Transferring" and stuck["last_progress_seconds_ago"] >= WINDOW / 2
        assert [e["event"] for e in stuck["events"]][-2:] == ["forward_done", "Transferring"]
        t.join(60)
        assert complete_eventually(url)["usage"]["completion_tokens"] == 4  # traffic flows again
        new_pid = httpx.get(f"{prefill}/server_info").json()["boot_id"]
        assert new_pid != old_pid, "the wedged prefill was not restarted"
        log = proc.log()
        for event in (
            "WedgeDetected prefill-0",
            "EvidenceCaptured prefill-0",
            "Drained prefill-0",
            "Restarted prefill-0",
        ):
            assert event in log, log
        # Drained and restarted through the router's /admin/workers: with the token, it is back.
        assert workers(up)["prefill"]["url"] == prefill
        # The decode waiting for that KV is the victim, not the cause: held, never restarted.
        assert "Restarted decode-0" not in log and "Drained decode-0" not in log
        assert "Crashed" not in log  # a watchdog restart is not a crash
        decode = workers(up)["decode"]["url"]
        assert httpx.post(f"{decode}/admin/drain", headers=up.admin).json() == {"draining": True}
    finally:
        proc.stop()


def test_up_with_deadlines_on_remediates_nothing(tmp_path, tiny_model):
    # The window (4 s) outlasts every deadline by two scrapes: bootstrap 3, transfer 1.5, waiting 2.5.
    up = start_up(
        tmp_path,
        tiny_model,
        "--engine-arg=--transfer-timeout=1.5",
        "--engine-arg=--waiting-timeout=2.5",
        "--engine-arg=--bootstrap-timeout=3",
    )
    url, evidence, proc = up.url, up.evidence, up.proc
    try:
        prefill = workers(up)["prefill"]["url"]
        httpx.post(
            f"{prefill}/admin/faults", json={"fault": "stall_transfer", "count": 2}, headers=up.admin
        ).raise_for_status()
        r = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": "stuck but healed", "max_tokens": 4, "ignore_eos": True},
            timeout=60,
        )
        # Two tries hit the stall; each fails at the engine's own deadline, well inside the window,
        # and the router sends the request again (migration): the client sees latency, no error.
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        assert 'dsv4:router_migrations_total{reason="engine_refused"} 2.0' in httpx.get(f"{url}/metrics").text
        time.sleep(WINDOW + 2)
        assert complete_eventually(url)["usage"]["completion_tokens"] == 4
        assert not list(evidence.glob("*")), "no remediation when the engine heals itself"
        assert "WedgeDetected" not in proc.log()
        loads = httpx.get(f"{prefill}/v1/loads", headers=up.admin).json()
        assert loads["counters"]["num_transfer_timeout_reqs"] == 2 and loads["queues"]["inflight"] == 0
    finally:
        proc.stop()


def wait_back(up: Up, key: str, url: str, old_pid: int, timeout: float) -> tuple[float, float]:
    """Seconds until process ``key`` is a new process, and until it answers /ready."""
    started = time.monotonic()
    spawned = None
    while True:
        pid = up.processes()[key]["pid"]
        if pid != old_pid and spawned is None:
            spawned = time.monotonic() - started
        try:
            if spawned is not None and httpx.get(url + "/ready", timeout=1.0).status_code == 200:
                return spawned, time.monotonic() - started
        except httpx.HTTPError:
            pass
        assert time.monotonic() - started < timeout, f"{key} not back after {timeout}s:\n{up.proc.log()}"
        time.sleep(0.05)


def test_up_restarts_a_crashed_process_without_the_watchdog(tmp_path, tiny_model):
    # A short window and no deadlines: a watchdog that took the crash for a wedge would act
    # within a few seconds, so its silence below means something.
    up = start_up(tmp_path, tiny_model, "--no-deadlines")
    torn: list[str] = []  # what a tight-loop reader of processes.json met that was not whole JSON
    reading = threading.Event()

    def read_processes() -> None:
        while not reading.is_set():
            text = (up.state / "processes.json").read_text()
            try:
                json.loads(text)
            except ValueError:
                torn.append(text)

    reader = threading.Thread(target=read_processes, daemon=True)
    reader.start()
    try:
        assert complete_eventually(up.url)["usage"]["completion_tokens"] == 4
        figures = {}
        for key in ("decode-0", "router"):
            info = up.processes()[key]
            url = up.url if key == "router" else f"http://127.0.0.1:{info['port']}"
            killed_at = time.monotonic()
            os.kill(info["pid"], signal.SIGKILL)
            figures[key + " (new process)"], figures[key + " (ready)"] = wait_back(
                up, key, url, info["pid"], CRASH_RESTART_BOUND_S
            )
            assert figures[key + " (new process)"] < 2.0  # at once: the first crash has no backoff
            complete_eventually(up.url)
            figures[key + " (service)"] = time.monotonic() - killed_at
            assert up.processes()[key]["restarts"] == 1 and up.processes()[key]["last_exit"] == -9
        print("restart after kill -9:", {k: round(v, 2) for k, v in figures.items()})
        # Give the watchdog a full window after the last restart, then look at what it did.
        after = time.time() + WINDOW + 1
        deadline = time.monotonic() + WINDOW + 30
        while up.status().get("time", 0) < after:
            assert time.monotonic() < deadline, up.proc.log()
            time.sleep(0.2)
        log = up.proc.log()
        assert "Crashed decode-0" in log and "Started decode-0" in log and "Crashed router" in log, log
        watchdog_events = [e for e in up.status()["events"] if e.get("source") == "watchdog"]
        assert watchdog_events == [] and not list(up.evidence.glob("*")), watchdog_events
        assert up.status()["policy"].get("active", {}) == {}, up.status()["policy"]
        reading.set()
        reader.join()
        assert torn == [], f"{len(torn)} reads of processes.json met a torn file: {torn[:3]}"
    finally:
        reading.set()
        up.proc.stop()
