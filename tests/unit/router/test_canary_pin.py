"""A canary worker gets no normal traffic; a pinned request reaches it (and only a ready one)."""

from __future__ import annotations

import pytest

from dsv4_router.router import Router
from dsv4_router.router_args import RouterArgs
from dsv4_wire import APIError


def _router() -> Router:
    r = Router(RouterArgs())
    for url, role, canary in (
        ("http://p", "prefill", False),
        ("http://d0", "decode", False),
        ("http://d1", "decode", True),
    ):
        w = r.pool.add(url, role)
        w.healthy, w.canary = True, canary
        w.bootstrap_port = 1 if role == "prefill" else None
    return r


def test_canary_is_out_of_rotation_but_pinnable():
    r = _router()
    assert {r._pair(set())[1].url for _ in range(50)} == {"http://d0"}
    assert r._pair({"http://d0"})[1].url == "http://d0"  # never falls back onto the canary
    p, d = r._pair(set(), pin="http://d1/")
    assert (p.url, d.url) == ("http://p", "http://d1")


def test_pin_refusals():
    r = _router()
    with pytest.raises(APIError) as e:
        r._pair(set(), pin="http://p")
    assert e.value.status == 400
    r.pool.workers["http://d1"].healthy = False
    with pytest.raises(APIError) as e:
        r._pair(set(), pin="http://d1")
    assert e.value.status == 503


async def test_pin_needs_the_admin_token_and_canary_flag_is_checked():
    import httpx

    from dsv4_router.app import build_app
    from dsv4_router.router import PIN_HEADER

    r = Router(RouterArgs(admin_token="secret"))
    transport = httpx.ASGITransport(app=build_app(r), client=("10.0.0.9", 1234))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
        body = {"prompt": "hi", "max_tokens": 1}
        got = await c.post("/v1/completions", json=body, headers={PIN_HEADER: "http://d1"})
        assert got.status_code == 401 and PIN_HEADER in got.json()["error"]["message"]
        got = await c.post(
            "/v1/completions", json=body, headers={PIN_HEADER: "http://nowhere", "Authorization": "Bearer secret"}
        )
        assert got.status_code == 400 and "not a decode or mono worker" in got.json()["error"]["message"]
        auth = {"Authorization": "Bearer secret"}
        got = await c.post(
            "/admin/workers", json={"url": "http://p:1", "role": "prefill", "canary": True}, headers=auth
        )
        assert got.status_code == 400
    await r.stop()


def test_a_canary_with_a_traffic_share_takes_that_share_of_live_picks():
    """trafficPercent: the canary takes its share of the role's picks, the rest stay on the
    stable pods; a canary that is not ready, or excluded after a failure, takes none."""
    r = _router()
    d1 = r.pool.workers["http://d1"]
    d1.canary_percent = 20.0
    assert r.pool.pick("decode", draw=10.0) is d1 and r.pool.pick("decode", draw=30.0).url == "http://d0"
    picks = [r.pool.pick("decode").url for _ in range(2000)]
    share = picks.count("http://d1") / len(picks)
    assert abs(share - 0.20) < 5 * (0.2 * 0.8 / len(picks)) ** 0.5, share  # 5 standard deviations
    assert r.pool.pick("decode", exclude={"http://d1"}, draw=0.0).url == "http://d0"
    d1.healthy = False
    assert r.pool.pick("decode", draw=0.0).url == "http://d0"


async def test_the_admin_sets_a_canary_share_and_clears_it_with_the_flag():
    import httpx

    from dsv4_router.app import build_app

    r = Router(RouterArgs(admin_token="secret"))

    async def no_health_check(worker) -> None:  # the worker is not there: the flags are what is tested
        return None

    r.health.check = no_health_check
    transport = httpx.ASGITransport(app=build_app(r), client=("10.0.0.9", 1234))
    auth = {"Authorization": "Bearer secret"}
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
        url = "http://127.0.0.1:1"
        for bad in (101, -1, "10", True):
            got = await c.post(
                "/admin/workers",
                json={"url": url, "role": "decode", "canary": True, "canary_percent": bad},
                headers=auth,
            )
            assert got.status_code == 400, bad
        got = await c.post("/admin/workers", json={"url": url, "role": "decode", "canary_percent": 10}, headers=auth)
        assert got.status_code == 400 and "canary" in got.json()["error"]["message"]  # a share needs the flag
        got = await c.post(
            "/admin/workers", json={"url": url, "role": "decode", "canary": True, "canary_percent": 10}, headers=auth
        )
        assert got.status_code == 200 and got.json()["canary_percent"] == 10.0
        got = await c.post("/admin/workers", json={"url": url, "role": "decode", "canary": False}, headers=auth)
        assert got.json()["canary"] is False and got.json()["canary_percent"] == 0.0
    await r.stop()
