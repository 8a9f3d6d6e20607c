"""Planned disruptions cost latency, not errors (issue 45): an engine that is shutting down is out
of rotation at its first refusal and the request goes elsewhere uncounted; a planned change's
hold keeps new requests waiting for a pair past --engine-wait-timeout, within their bound."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from dsv4_router.hold import PlannedHold, draining_refusal, may_keep_waiting, parse_hold
from dsv4_router.migration import DRAINING, NEVER_RAN, REFUSED
from dsv4_router.router import Router
from dsv4_router.router_args import RouterArgs
from dsv4_wire import APIError
from dsv4_wire.errors import SHUTTING_DOWN


def _body(code) -> bytes:
    return json.dumps(APIError("shutting down", 503, "server_error", code=code).body()).encode()


def test_only_a_shutting_down_503_is_a_draining_refusal():
    assert draining_refusal(503, _body(SHUTTING_DOWN))
    assert not draining_refusal(503, _body("overloaded"))
    assert not draining_refusal(500, _body(SHUTTING_DOWN))
    assert not draining_refusal(503, b"")
    assert not draining_refusal(503, b"<html>bad gateway</html>")
    assert DRAINING in NEVER_RAN and REFUSED not in NEVER_RAN  # a drain costs no --migration-limit


def test_waiting_rule():
    # within --engine-wait-timeout: always; past it only while a hold lasts, and never past the bound
    assert may_keep_waiting(5.0, 30.0, 0.0, 600.0)
    assert not may_keep_waiting(31.0, 30.0, 0.0, 600.0)
    assert may_keep_waiting(31.0, 30.0, 10.0, 600.0)
    assert not may_keep_waiting(601.0, 30.0, 10.0, 600.0)


def test_hold_is_a_lease_that_lapses():
    h = PlannedHold()
    h.set(5.0, "roll of prefill-0", now=100.0)
    assert h.view(101.0) == {"holding": True, "seconds_left": 4.0, "reason": "roll of prefill-0"}
    assert h.left(106.0) == 0.0 and h.view(106.0)["holding"] is False
    h.set(5.0, "again", now=200.0)
    h.clear()
    assert h.left(200.0) == 0.0
    assert parse_hold({"seconds": 30, "reason": "x"}) == (30.0, "x")
    assert parse_hold({"seconds": -1}) is None and parse_hold({"seconds": True}) is None
    assert parse_hold({"seconds": 1e9}) is None and parse_hold({"reason": "no seconds"}) is None


async def test_a_held_request_waits_past_the_engine_wait_timeout_until_the_hold_ends():
    """Through the router's HTTP app: no pair is healthy (the only prefill restarting); without a
    hold the request gets its 503 after --engine-wait-timeout; with one it waits, and gets the 503
    only once the driver clears the hold (a real pair would have served it meanwhile)."""
    from dsv4_router.app import build_app

    r = Router(RouterArgs(engine_wait_timeout=0.3, admin_token="secret"))
    for url, role in (("http://127.0.0.1:9/p", "prefill"), ("http://127.0.0.1:9/d", "decode")):
        r.pool.add(url, role)  # never checked: not healthy
    auth = {"Authorization": "Bearer secret"}
    transport = httpx.ASGITransport(app=build_app(r), client=("127.0.0.1", 1234))
    async with httpx.AsyncClient(transport=transport, base_url="http://router", timeout=30) as c:
        body = {"prompt": "hi", "max_tokens": 1}
        t = time.monotonic()
        got = await c.post("/v1/completions", json=body)
        assert got.status_code == 503 and "no healthy prefill/decode pair" in got.json()["error"]["message"]
        assert time.monotonic() - t < 3.0
        assert (await c.post("/admin/hold", json={"seconds": 30})).status_code == 401
        assert (await c.post("/admin/hold", json={"seconds": -2}, headers=auth)).status_code == 400
        got = await c.post("/admin/hold", json={"seconds": 30, "reason": "roll of prefill-0"}, headers=auth)
        assert got.status_code == 200 and got.json()["holding"] is True
        request = asyncio.ensure_future(c.post("/v1/completions", json=body))
        await asyncio.sleep(1.5)  # five times --engine-wait-timeout
        assert not request.done()
        assert (await c.get("/admin/hold", headers=auth)).json()["reason"] == "roll of prefill-0"
        assert (await c.delete("/admin/hold", headers=auth)).json()["holding"] is False
        got = await asyncio.wait_for(request, 5.0)
        assert got.status_code == 503
    await r.stop()
