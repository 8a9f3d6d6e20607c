"""A canary worker gets no normal traffic; a pinned request reaches it (and only a ready one)."""

from __future__ import annotations

import pytest

from dsv4_router.router import Router, RouterArgs
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

    from dsv4_router.router import PIN_HEADER, build_app

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
