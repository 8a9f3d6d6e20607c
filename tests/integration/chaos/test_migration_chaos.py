"""A fault costs latency, never an error: streams move off an engine that dies or drains, and
every client gets the answer an undisturbed run gives (greedy), whole, once, under one id.

Real processes on 127.0.0.1 (tiny model): a prefill engine, two decode engines and the router.
Each test runs the same streams undisturbed first, then with the fault, and compares.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from migration_chaos import Cluster, body_for, mismatches, streams, wait_idle

STREAMS = 24
TOKENS = 96


@pytest.fixture
def cluster(tiny_model, tmp_path):
    c = Cluster(tiny_model, tmp_path, decodes=2)
    yield c
    c.stop()


def _disturbed(c: Cluster, bodies: list[dict], fault, chat: bool = False) -> list:
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(out=streams(c.r_url, bodies, chat=chat)))
    t.start()
    try:
        fault()
    finally:
        t.join(180)
    assert not t.is_alive(), "a client hangs\n" + c.logs()
    return box["out"]


def _migrations(c: Cluster) -> float:
    total = 0.0
    for line in c.metric("").splitlines():
        if line.startswith("dsv4:router_migrations_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_decode_sigkill_mid_stream_costs_no_client_an_error(cluster):
    c = cluster
    bodies = [body_for(i, TOKENS) for i in range(STREAMS)]
    want = streams(c.r_url, bodies)
    assert all(w.ok for w in want), [w.error for w in want if not w.ok]

    def kill():
        c.wait_running("decode0", 6)
        time.sleep(0.3)  # mid-stream: tokens are out
        c.kill("decode0")

    got = _disturbed(c, bodies, kill)
    bad = mismatches(got, want, TOKENS)
    assert not bad, "\n".join(bad[:5]) + "\n" + c.logs()
    assert _migrations(c) >= 1, c.metric("")
    wait_idle([c.urls["prefill"], c.urls["decode1"]])
