"""One admin rule for engines and router (dsv4_wire.admin_refusal): with a token configured the
request must carry it; without one, only loopback clients may call admin endpoints."""

from __future__ import annotations

from dsv4_wire import admin_refusal, authorization_header

TOKEN = "t0k3n"


def test_a_configured_token_is_required_from_everyone():
    assert admin_refusal(authorization_header(TOKEN), TOKEN, "10.1.2.3") is None
    assert admin_refusal(authorization_header(TOKEN), TOKEN, "127.0.0.1") is None
    assert admin_refusal({}, TOKEN, "127.0.0.1")[0] == 401
    assert admin_refusal(authorization_header("wrong"), TOKEN, "127.0.0.1")[0] == 401
    assert admin_refusal({"authorization": f"Basic {TOKEN}"}, TOKEN, "127.0.0.1")[0] == 401


def test_without_a_token_only_loopback_clients_pass():
    for host in ("127.0.0.1", "::1", "127.9.9.9"):
        assert admin_refusal({}, None, host) is None
    for host in ("10.0.0.7", "192.168.1.4", "203.0.113.9", None, "testclient"):
        refusal = admin_refusal({}, None, host)
        assert refusal is not None and refusal[0] == 403 and "loopback" in refusal[1]
