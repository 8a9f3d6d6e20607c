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

from bench.harness.migration_chaos import Cluster, body_for, mismatches, streams, wait_idle

STREAMS = 24
TOKENS = 128  # streams long enough that a kill 0.15 s after admission lands mid-stream


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
        time.sleep(0.15)  # mid-stream: tokens are out
        c.kill("decode0")

    got = _disturbed(c, bodies, kill)
    bad = mismatches(got, want, TOKENS)
    assert not bad, "\n".join(bad[:5]) + "\n" + c.logs()
    assert _migrations(c) >= 1, c.metric("")
    wait_idle([c.urls["prefill"], c.urls["decode1"]])


def _mixed(n: int) -> tuple[list[dict], list[dict]]:
    """Completions: greedy, seeded sampling, and non-streamed; and greedy chat streams."""
    comp = []
    for i in range(n):
        kind = i % 3
        extra = {"temperature": 0.8, "seed": 1000 + i} if kind == 1 else {}
        b = body_for(i, TOKENS, **extra)
        if kind == 2:
            b.pop("stream_options")
            b["stream"] = False
        comp.append(b)
    chat = [body_for(i, TOKENS, chat=True) for i in range(n)]
    return comp, chat


def test_chat_seeded_and_unstreamed_requests_move_too(cluster):
    c = cluster
    comp, chat = _mixed(12)
    want_c, want_chat = streams(c.r_url, comp), streams(c.r_url, chat, chat=True)
    assert all(w.ok for w in want_c + want_chat)
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(chat=streams(c.r_url, chat, chat=True)))
    t.start()
    got_c = _disturbed(c, comp, lambda: (c.wait_running("decode1", 8), time.sleep(0.15), c.kill("decode1")))
    t.join(180)
    bad = mismatches(got_c, want_c, TOKENS) + mismatches(box["chat"], want_chat, TOKENS)
    assert not bad, "\n".join(bad[:5]) + "\n" + c.logs()
    assert _migrations(c) >= 1
    wait_idle([c.urls["prefill"], c.urls["decode0"]])


def test_sigterm_drain_past_its_grace_moves_the_rest(tiny_model, tmp_path):
    """decode0 drains with 1 s of grace under streams that need longer: what is left when the
    grace ends moves to decode1, and decode0 exits 0."""
    c = Cluster(tiny_model, tmp_path, decodes=2, decode_args=["--shutdown-grace", 1])
    try:
        bodies = [body_for(i, TOKENS * 2) for i in range(STREAMS)]
        want = streams(c.r_url, bodies)
        assert all(w.ok for w in want)

        def term():
            c.wait_running("decode0", 6)
            time.sleep(0.15)
            c.kill("decode0", signal.SIGTERM)

        got = _disturbed(c, bodies, term)
        bad = mismatches(got, want, TOKENS * 2)
        assert not bad, "\n".join(bad[:5]) + "\n" + c.logs()
        assert c.procs["decode0"].popen.wait(30) == 0
        assert "engine_error" in c.metric("")  # moved on the engine's own "shutting down" event
        wait_idle([c.urls["prefill"], c.urls["decode1"]])
    finally:
        c.stop()


def test_prefill_sigkill_mid_transfer(tiny_model, tmp_path):
    """prefill0 dies while requests are being prefilled or handed over: they go through prefill1."""
    c = Cluster(tiny_model, tmp_path, decodes=1, prefills=2)
    try:
        bodies = [body_for(i, 32) for i in range(STREAMS)]
        for i, b in enumerate(bodies):  # longer prompts: prefill takes a while
            b["prompt"] = [(11 * i + j) % 400 + 3 for j in range(200 + i)]
        want = streams(c.r_url, bodies)
        assert all(w.ok for w in want)

        def kill():
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                ld = httpx.get(f"{c.urls['prefill']}/v1/loads", timeout=5).json()["queues"]
                if sum(ld.values()) >= 2:
                    break
                time.sleep(0.01)
            c.kill("prefill")

        got = _disturbed(c, bodies, kill)
        bad = mismatches(got, want, 32)
        assert not bad, "\n".join(bad[:5]) + "\n" + c.logs()
        wait_idle([c.urls["prefill1"], c.urls["decode0"]])
    finally:
        c.stop()


def test_lone_decode_killed_and_restarted_takes_its_streams_back(tiny_model, tmp_path):
    """No other decode engine: the streams wait (within --migration-timeout) for the killed one
    to come back, then continue on it."""
    c = Cluster(tiny_model, tmp_path, decodes=1)
    try:
        bodies = [body_for(i, TOKENS) for i in range(STREAMS)]
        want = streams(c.r_url, bodies)

        def kill_and_restart():
            c.wait_running("decode0", 6)
            time.sleep(0.15)
            c.kill("decode0")
            c.restart("decode0")

        got = _disturbed(c, bodies, kill_and_restart)
        bad = mismatches(got, want, TOKENS)
        assert not bad, "\n".join(bad[:5]) + "\n" + c.logs()
        wait_idle([c.urls["prefill"], c.urls["decode0"]])
    finally:
        c.stop()


@pytest.mark.slow  # ~85 s: dsv4 up boots five engines on 2 shared cores
def test_watchdog_remediating_a_wedge_costs_no_client_an_error(tiny_model, tmp_path):
    """`dsv4 up --prefill 2` without PD deadlines: one KV transfer of prefill-0 stalls for good
    (the production wedge). The watchdog captures, drains, aborts and restarts prefill-0; the
    wedged request and whatever else prefill-0 held move to prefill-1, and every client gets
    its whole, undisturbed answer."""
    from bench.harness.migration_chaos import LocalUp

    up = LocalUp(
        tiny_model,
        tmp_path,
        "--prefill",
        2,
        "--enable-fault-injection",
        "--no-deadlines",
        "--detection-window",
        3,
        "--scrape-interval",
        0.5,
    )
    try:
        bodies = [body_for(i, TOKENS) for i in range(STREAMS)]
        want = streams(up.url, bodies)
        assert all(w.ok for w in want), [w.error for w in want if not w.ok]
        p0 = up.engine_url("prefill-0")
        old_boot = httpx.get(f"{p0}/server_info").json()["boot_id"]
        httpx.post(
            f"{p0}/admin/faults", json={"fault": "stall_transfer", "count": 1}, headers=up.admin
        ).raise_for_status()
        got = streams(up.url, bodies, deadline_s=120)
        bad = mismatches(got, want, TOKENS)
        log = up.proc.log()
        assert not bad, "\n".join(bad[:5]) + "\n" + log
        for event in ("WedgeDetected prefill-0", "Drained prefill-0", "Aborted prefill-0", "Restarted prefill-0"):
            assert event in log, log
        assert "dsv4:router_migrations_total" in httpx.get(f"{up.url}/metrics").text
        deadline = time.monotonic() + 60
        while True:  # the restarted prefill is back in rotation, and every engine is idle
            try:
                if httpx.get(f"{p0}/server_info").json()["boot_id"] != old_boot:
                    wait_idle([up.engine_url(k) for k in ("prefill-0", "prefill-1", "decode-0")])
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, up.proc.log()
            time.sleep(0.5)
    finally:
        up.stop()


def test_v4_decode_sigkill_mid_stream(make_model, tmp_path):
    """The same on DeepSeek-V4 (v4-tiny): the new decode receives prompt + continuation with
    every V4 state (window ring, compressors, indexer) from the prefill that recomputes them."""
    c = Cluster(make_model("v4-tiny"), tmp_path, decodes=2)
    try:
        # long enough that the kill lands mid-stream: with the native CPU kernels a v4-tiny
        # decode step is a few ms (less each pass), and 48-token streams had ended before it
        n, tokens = 12, 256
        bodies = [body_for(i, tokens) for i in range(n)]
        want = streams(c.r_url, bodies)
        assert all(w.ok for w in want)

        def kill():
            c.wait_running("decode0", 3)
            time.sleep(0.1)
            c.kill("decode0")

        got = _disturbed(c, bodies, kill)
        bad = mismatches(got, want, tokens)
        assert not bad, "\n".join(bad[:5]) + "\n" + c.logs()
        assert _migrations(c) >= 1
        wait_idle([c.urls["prefill"], c.urls["decode1"]])
    finally:
        c.stop()


@pytest.mark.parametrize("n", [1, 2])
def test_past_the_migration_timeout_one_clear_error(tiny_model, tmp_path, n):
    """The lone decode engine dies and stays dead: every stream waits at most --migration-timeout
    for another, then ends with one error event naming the bound (no hang, no cut). With n = 2
    the stream split into one continuation per choice: still one error, not one per choice."""
    c = Cluster(tiny_model, tmp_path, decodes=1, router_args=["--migration-timeout", 3])
    try:
        extra = {"n": 2, "temperature": 0.9, "seed": 5} if n == 2 else {}
        bodies = [body_for(i, TOKENS * 2, **extra) for i in range(8)]

        def kill():
            c.wait_running("decode0", 4)
            time.sleep(0.3)
            c.kill("decode0")

        t0 = time.monotonic()
        got = _disturbed(c, bodies, kill)
        assert time.monotonic() - t0 < 30
        for s in got:
            assert s.done and s.error is not None and "--migration-timeout" in s.error, (s.error, c.logs())
            assert s.errors == 1, s.errors
            assert s.finish is None and s.text  # what the client had stays; nothing after the error
        wait_idle([c.urls["prefill"]])
    finally:
        c.stop()
