"""Frozen is not dead (issue 45): an engine stopped with SIGSTOP keeps its sockets open, so
nothing fails on its own: its streams just stop. The router notices the gap (far past the
stream's pace), finds the engine's /ready unanswered, takes it out of rotation and moves its
streams: every client gets the undisturbed answer, within seconds, not after the engine's
600 s read timeout.

Real processes on 127.0.0.1 (tiny model): prefill, two decode engines (two prefills for the
prefill case) and the router. The whole engine (its HTTP process and its core) is frozen, as a
frozen pod's container is.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from bench.harness.migration_chaos import Cluster, body_for, mismatches, streams, wait_idle

STREAMS = 16
TOKENS = 96
MOVED_WITHIN_S = 25.0  # the round with a frozen engine (undisturbed: a few seconds on 2 cores)


def _freeze(c: Cluster, name: str, sig: int) -> None:
    os.killpg(c.procs[name].popen.pid, sig)  # the engine's process group: HTTP process and core


def _frozen_round(c: Cluster, bodies: list[dict], freeze) -> tuple[list, float]:
    box: dict = {}
    t0 = time.monotonic()
    t = threading.Thread(target=lambda: box.update(out=streams(c.r_url, bodies, deadline_s=60)))
    t.start()
    try:
        freeze()
    finally:
        t.join(90)
    assert not t.is_alive(), "a client hangs\n" + c.logs()
    return box["out"], time.monotonic() - t0


def _workers(c: Cluster) -> dict:
    return {w["url"]: w for w in httpx.get(f"{c.r_url}/admin/workers", timeout=5).json()["workers"]}


def _frozen_moves(c: Cluster) -> float:
    total = 0.0
    for line in c.metric("").splitlines():
        if line.startswith('dsv4:router_migrations_total{reason="engine_frozen"}'):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.slow  # ~18 s; the default run has it as the fault matrix's decode_sigstop cell (test_fault_matrix.py)
def test_a_decode_frozen_mid_stream_costs_latency_not_errors(tiny_model, tmp_path):
    c = Cluster(tiny_model, tmp_path, decodes=2)
    try:
        bodies = [body_for(i, TOKENS) for i in range(STREAMS)]
        want = streams(c.r_url, bodies)
        assert all(w.ok for w in want), [w.error for w in want if not w.ok]

        def freeze():
            c.wait_running("decode0", 4)
            time.sleep(0.2)  # mid-stream: tokens are out
            _freeze(c, "decode0", signal.SIGSTOP)

        got, took = _frozen_round(c, bodies, freeze)
        bad = mismatches(got, want, TOKENS)
        assert not bad, "\n".join(bad[:5]) + "\n" + c.logs()
        assert took < MOVED_WITHIN_S, f"the round took {took:.1f}s"
        assert _frozen_moves(c) >= 1, c.metric("")
        w = _workers(c)[c.urls["decode0"]]
        assert not w["healthy"] and "frozen" in w["reason"] or "no answer" in w["reason"], w
        # no request is routed to it while it is frozen
        after = streams(c.r_url, bodies[:4], deadline_s=60)
        assert all(s.ok for s in after), [s.error for s in after]
        wait_idle([c.urls["prefill"], c.urls["decode1"]])
        _freeze(c, "decode0", signal.SIGCONT)  # thawed: it sees its clients gone and frees their pages
        wait_idle([c.urls["decode0"]], timeout=30)
    finally:
        for name in c.procs:
            try:
                _freeze(c, name, signal.SIGCONT)
            except ProcessLookupError:
                pass
        c.stop()


@pytest.mark.slow  # ~40 s: four engines on 2 shared cores
def test_a_prefill_frozen_before_its_transfer_costs_latency_not_errors(tiny_model, tmp_path):
    c = Cluster(tiny_model, tmp_path, decodes=1, prefills=2)
    try:
        bodies = [body_for(i, TOKENS) for i in range(STREAMS)]
        want = streams(c.r_url, bodies)
        assert all(w.ok for w in want), [w.error for w in want if not w.ok]
        _freeze(c, "prefill", signal.SIGSTOP)  # frozen before the round: its first requests wait on it
        got, took = _frozen_round(c, bodies, lambda: None)
        bad = mismatches(got, want, TOKENS)
        assert not bad, "\n".join(bad[:5]) + "\n" + c.logs()
        assert took < MOVED_WITHIN_S, f"the round took {took:.1f}s"
        deadline = time.monotonic() + 10  # out of rotation within a few checks, whether or not it held a request
        while _workers(c)[c.urls["prefill"]]["healthy"]:
            assert time.monotonic() < deadline, _workers(c)
            time.sleep(0.2)
        wait_idle([c.urls["prefill1"], c.urls["decode0"]])
    finally:
        for name in c.procs:
            try:
                _freeze(c, name, signal.SIGCONT)
            except ProcessLookupError:
                pass
        c.stop()


@pytest.mark.slow  # ~25 s: an engine restarted on 2 shared cores
def test_new_requests_wait_for_the_only_prefill_to_come_back_instead_of_a_503(tiny_model, tmp_path):
    """A planned restart of a role with one replica (`dsv4 up --reconfigure`, a roll): requests
    that arrive while no pair is healthy are held (--engine-wait-timeout) until it is back."""
    c = Cluster(tiny_model, tmp_path, decodes=1)
    try:
        c.kill("prefill")
        deadline = time.monotonic() + 10
        while _workers(c)[c.urls["prefill"]]["healthy"]:  # the router saw it go
            assert time.monotonic() < deadline
            time.sleep(0.1)
        bodies = [body_for(i, 16) for i in range(4)]
        box: dict = {}
        t = threading.Thread(target=lambda: box.update(out=streams(c.r_url, bodies, deadline_s=60)))
        t.start()
        c.restart("prefill")
        t.join(90)
        assert all(s.ok for s in box["out"]), [s.error for s in box["out"]]
    finally:
        c.stop()
