"""`dsv4 up` end to end on one machine: a reproduced wedge is detected and healed by the local
watchdog; with the engine's own deadlines on, the engine heals itself and nothing is touched."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from dsv4_testutil import Proc, free_port_block

WINDOW = 4.0


def start_up(tmp: Path, model: Path, *extra: str) -> tuple[Proc, str, Path]:
    port = free_port_block()
    evidence = tmp / "evidence"
    proc = Proc(["up", "--model", model, "--port", port, "--enable-fault-injection", "--detection-window", WINDOW,
                 "--scrape-interval", 0.5, "--evidence-dir", evidence, *extra], tmp / "up.log",
                env={"DSV4_CACHE": str(tmp / "cache")})
    url = f"http://127.0.0.1:{port}"
    proc.wait_ready(url, timeout=120)
    return proc, url, evidence


def workers(url: str) -> dict[str, dict]:
    return {w["role"]: w for w in httpx.get(f"{url}/admin/workers").json()["workers"]}


def complete_eventually(url: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "after the storm", "max_tokens": 4, "ignore_eos": True}, timeout=30)
        if r.status_code == 200:
            return r.json()
        assert time.monotonic() < deadline, r.text
        time.sleep(0.5)


def wedge_request(url: str) -> threading.Thread:
    t = threading.Thread(target=lambda: httpx.post(f"{url}/v1/completions", json={"prompt": "stuck", "max_tokens": 4},
                                                   timeout=120), daemon=True)
    t.start()
    return t


def test_up_heals_a_reproduced_wedge(tmp_path, tiny_model):
    proc, url, evidence = start_up(tmp_path, tiny_model, "--no-deadlines")
    try:
        assert complete_eventually(url)["usage"]["completion_tokens"] == 4
        prefill = workers(url)["prefill"]["url"]
        old_pid = httpx.get(f"{prefill}/server_info").json()["boot_id"]
        httpx.post(f"{prefill}/admin/faults", json={"fault": "stall_transfer", "count": 1}).raise_for_status()
        t = wedge_request(url)
        deadline = time.monotonic() + WINDOW + 30
        while not any(p.name.startswith("local-evidence-prefill") for p in evidence.glob("*")):
            assert time.monotonic() < deadline, proc.log()
            time.sleep(0.3)
        folder = next(p for p in evidence.glob("local-evidence-prefill*"))
        verdict = json.loads((folder / "verdict.json").read_text())
        assert verdict["state"] == "Wedged" and verdict["reason"] == "stuck_inflight"
        assert "dsv4-engine" in (folder / "stacks.txt").read_text()
        assert json.loads((folder / "loads.json").read_text())["queues"]["inflight"] == 1
        t.join(60)
        assert complete_eventually(url)["usage"]["completion_tokens"] == 4  # traffic flows again
        new_pid = httpx.get(f"{prefill}/server_info").json()["boot_id"]
        assert new_pid != old_pid, "the wedged prefill was not restarted"
        log = proc.log()
        for event in ("WedgeDetected prefill-0", "EvidenceCaptured prefill-0", "Drained prefill-0", "Restarted prefill-0"):
            assert event in log, log
        # The decode waiting for that KV is the victim, not the cause: held, never restarted.
        assert "Restarted decode-0" not in log and "Drained decode-0" not in log
    finally:
        proc.stop()


def test_up_with_deadlines_on_remediates_nothing(tmp_path, tiny_model):
    proc, url, evidence = start_up(tmp_path, tiny_model, "--engine-arg=--transfer-timeout=1.5",
                                   "--engine-arg=--waiting-timeout=2.5")
    try:
        prefill = workers(url)["prefill"]["url"]
        httpx.post(f"{prefill}/admin/faults", json={"fault": "stall_transfer", "count": 2}).raise_for_status()
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "stuck but healed", "max_tokens": 4, "ignore_eos": True}, timeout=60)
        # Both tries hit the stall; each fails at the engine's own deadline, well inside the window.
        assert r.status_code in (502, 504) and "timed out" in r.json()["error"]["message"], r.text
        time.sleep(WINDOW + 2)
        assert complete_eventually(url)["usage"]["completion_tokens"] == 4
        assert not list(evidence.glob("*")), "no remediation when the engine heals itself"
        assert "WedgeDetected" not in proc.log()
        loads = httpx.get(f"{prefill}/v1/loads").json()
        assert loads["counters"]["num_transfer_timeout_reqs"] == 2 and loads["queues"]["inflight"] == 0
    finally:
        proc.stop()
