"""Engine-to-engine PD endpoints and bootstrap targets behind the shared PD secret, between real
prefill and decode processes on 127.0.0.1 (no router: the test sends what the router would)."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest

from bench.harness.commands import Proc, free_port, stop_all
from dsv4_wire import Paths, authorization_header

SECRET, ADMIN = "pd-secret-for-tests", "admin-token-for-tests"


@pytest.fixture(scope="module")
def pair(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd-auth")
    p_port, b_port, d_port = free_port(), free_port(), free_port()
    common = [
        "serve",
        "--model",
        tiny_model,
        "--kv-pages",
        64,
        "--page-size",
        16,
        "--served-model-name",
        "m",
        "--enable-fault-injection",
        "--pd-secret",
        SECRET,
        "--admin-token",
        ADMIN,
    ]
    procs = [
        Proc([*common, "--role", "prefill", "--port", p_port, "--bootstrap-port", b_port], tmp / "prefill.log"),
        Proc([*common, "--role", "decode", "--port", d_port], tmp / "decode.log"),
    ]
    urls = {
        "prefill": f"http://127.0.0.1:{p_port}",
        "bootstrap": f"http://127.0.0.1:{b_port}",
        "decode": f"http://127.0.0.1:{d_port}",
        "b_port": b_port,
    }
    try:
        procs[0].wait_ready(urls["prefill"])
        procs[1].wait_ready(urls["decode"])
        yield urls
    finally:
        stop_all(procs)


def _internal_calls(urls):
    return [
        ("POST", urls["prefill"] + Paths.PD_ABORT, {"room": 1, "reason": "x"}),
        ("POST", urls["decode"] + Paths.PD_ABORT, {"room": 1, "reason": "x"}),
        ("POST", urls["bootstrap"] + Paths.BOOTSTRAP_REGISTER, {"room": 1}),
        ("POST", urls["bootstrap"] + Paths.BOOTSTRAP_ABORT, {"room": 1, "reason": "x"}),
        ("GET", urls["bootstrap"] + Paths.BOOTSTRAP_HEARTBEAT + "?decode_boot=intruder", None),
    ]


@pytest.mark.parametrize(
    "headers", [{}, authorization_header("wrong"), authorization_header(ADMIN)], ids=["none", "wrong", "admin-token"]
)
def test_every_pd_internal_endpoint_refuses_without_the_secret(pair, headers):
    for method, url, body in _internal_calls(pair):
        r = httpx.request(method, url, json=body, headers=headers, timeout=10)
        assert r.status_code == 401, (url, r.status_code, r.text)
        assert r.json()["error"]["type"] == "authentication_error"


def test_pd_internal_endpoints_answer_with_the_secret(pair):
    statuses = {
        url: httpx.request(method, url, json=body, headers=authorization_header(SECRET), timeout=10).status_code
        for method, url, body in _internal_calls(pair)
    }
    # The registration body is incomplete: authenticated, then refused as bad input.
    assert statuses.pop(pair["bootstrap"] + Paths.BOOTSTRAP_REGISTER) == 400
    assert set(statuses.values()) == {200}, statuses


def test_fault_injection_needs_the_admin_token_not_the_pd_secret(pair):
    for headers in ({}, authorization_header(SECRET)):
        assert httpx.get(pair["prefill"] + Paths.ADMIN_FAULTS, headers=headers).status_code == 401
    assert httpx.get(pair["prefill"] + Paths.ADMIN_FAULTS, headers=authorization_header(ADMIN)).json() == {"armed": {}}


def test_decode_never_dials_a_bootstrap_target_a_client_supplied(pair):
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(4)
    trap.settimeout(0.5)
    try:
        body = {
            "prompt": [5, 6, 7],
            "max_tokens": 2,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": trap.getsockname()[1],
            "bootstrap_room": 31337,
        }
        for role in ("decode", "prefill"):
            r = httpx.post(pair[role] + Paths.COMPLETIONS, json=body, timeout=30)
            assert r.status_code == 401 and "PD secret" in r.json()["error"]["message"], r.text
        with pytest.raises(socket.timeout):
            trap.accept()  # nobody came
    finally:
        trap.close()


def test_a_pd_request_with_the_secret_goes_through_end_to_end(pair):
    """What the router does: both engines, the secret on each; decode then registers and
    heartbeats with the prefill's bootstrap server under the same secret."""
    body = {
        "prompt": list(range(5, 40)),
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": pair["b_port"],
        "bootstrap_room": 4242,
    }
    headers = authorization_header(SECRET)
    res = {}
    t = threading.Thread(
        target=lambda: res.update(
            p=httpx.post(pair["prefill"] + Paths.COMPLETIONS, json=body, headers=headers, timeout=120)
        )
    )
    t.start()
    d = httpx.post(pair["decode"] + Paths.COMPLETIONS, json=body, headers=headers, timeout=120)
    t.join(120)
    assert res["p"].status_code == 200, res["p"].text
    assert d.status_code == 200, d.text
    assert len(d.json()["choices"][0]["token_ids"]) == 4
    loads = httpx.get(pair["prefill"] + Paths.LOADS, headers={"Authorization": f"Bearer {ADMIN}"}).json()
    assert loads["counters"]["kv_transfers_completed"] >= 1
