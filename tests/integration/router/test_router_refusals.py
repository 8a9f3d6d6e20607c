"""The router as a real process in front of a real monolithic engine: what it answers by itself
(bad bodies, unknown paths, size limit) is OpenAI-shaped, and who may use /admin/workers."""

from __future__ import annotations

import httpx
import pytest

from bench.harness.commands import free_port, stop_all

TOKEN = "s3cret-admin"
CLIENT_TIMEOUT = 2.0
logs: dict = {}


@pytest.fixture(scope="module")
def routers(tiny_model, tmp_path_factory):
    from bench.harness.commands import Proc

    tmp = tmp_path_factory.mktemp("router-edges")
    logs["router"] = tmp / "router.log"
    e_port, r_port, t_port = free_port(), free_port(), free_port()
    engine = Proc(
        ["serve", "--model", tiny_model, "--role", "mono", "--port", e_port, "--served-model-name", "m"],
        tmp / "mono.log",
    )
    open_router = Proc(
        [
            "router",
            "--mono",
            f"http://127.0.0.1:{e_port}",
            "--port",
            r_port,
            "--health-interval",
            "0.5",
            "--max-body-bytes",
            8192,
            "--client-timeout",
            CLIENT_TIMEOUT,
        ],
        tmp / "router.log",
    )
    token_router = Proc(
        [
            "router",
            "--mono",
            f"http://127.0.0.1:{e_port}",
            "--port",
            t_port,
            "--health-interval",
            "0.5",
            "--admin-token",
            TOKEN,
        ],
        tmp / "router-token.log",
    )
    procs = [engine, open_router, token_router]
    try:
        engine.wait_ready(f"http://127.0.0.1:{e_port}")
        open_router.wait_ready(f"http://127.0.0.1:{r_port}")
        token_router.wait_ready(f"http://127.0.0.1:{t_port}")
        yield {
            "engine": f"http://127.0.0.1:{e_port}",
            "open": f"http://127.0.0.1:{r_port}",
            "token": f"http://127.0.0.1:{t_port}",
        }
    finally:
        stop_all(procs)


def assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err and "param" in err and "code" in err
    return err


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "x", "temperature": NaN}',
        b'{"prompt": "x", "top_p": Infinity}',
        b'{"prompt": "x", "temperature": 1e999}',
        b'{"prompt": "x", "max_tokens": ' + b"1" * 5000 + b"}",
        b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}",
        b"{nope",
        b"[1, 2]",
        b'{"prompt": "\\ud800", "max_tokens": 2}',  # a lone surrogate: no character, not forwardable
    ],
)
def test_hostile_json_is_400_not_500(routers, raw):
    r = httpx.post(
        f"{routers['open']}/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=10
    )
    assert_openai_error(r, 400)


# Issue 39, through the router: each is refused before any engine sees it.
ROUTER_HOSTILE = [
    ({"prompt": ["x"] * 256, "n": 16, "max_tokens": 1}, "n"),  # 4,096 sequences
    ({"prompt": "x", "rid": "a\nINFO forged"}, "rid"),
]
# ... and those the engine refuses (a 400 the router passes on, sent once, the engine kept).
ENGINE_HOSTILE = [
    {"prompt": "x", "guided_regex": "a{0,100000000}"},
    {"prompt": "x", "guided_json": {"type": "string", "maxLength": 10**8}},
]


@pytest.mark.parametrize("body,param", ROUTER_HOSTILE)
def test_issue_39_hostile_bodies_are_400_at_the_router(routers, body, param):
    before = _worker_requests(routers["open"])
    r = httpx.post(f"{routers['open']}/v1/completions", json=body, timeout=30)
    assert assert_openai_error(r, 400)["param"] == param
    assert _worker_requests(routers["open"]) == before


@pytest.mark.parametrize("body", ENGINE_HOSTILE)
def test_issue_39_hostile_bodies_the_engine_refuses_are_400_once(routers, body):
    before = _worker_requests(routers["open"])
    assert_openai_error(httpx.post(f"{routers['open']}/v1/completions", json=body, timeout=30), 400)
    assert _worker_requests(routers["open"]) == before + 1
    assert httpx.get(f"{routers['open']}/admin/workers").json()["workers"][0]["healthy"]


def test_body_size_limit_is_413(routers):
    r = httpx.post(f"{routers['open']}/v1/completions", json={"prompt": "x" * 20000, "max_tokens": 1}, timeout=10)
    assert assert_openai_error(r, 413)["code"] == "request_too_large"

    def chunked():  # no Content-Length: refused while reading
        for _ in range(10):
            yield b" " * 2000

    r = httpx.post(
        f"{routers['open']}/v1/completions", content=chunked(), headers={"content-type": "application/json"}, timeout=10
    )
    assert_openai_error(r, 413)


def test_unknown_paths_and_methods_are_openai_shaped(routers):
    assert_openai_error(httpx.post(f"{routers['open']}/v1/nope", json={}), 404)
    assert_openai_error(httpx.get(f"{routers['open']}/v1/completions"), 405)
    assert_openai_error(httpx.put(f"{routers['open']}/admin/workers", json={}), 405)


def test_client_supplied_bootstrap_fields_are_not_forwarded(routers):
    # a mono engine would refuse nothing here; what matters is that the request is served normally
    r = httpx.post(
        f"{routers['open']}/v1/completions",
        timeout=30,
        json={
            "prompt": [5, 6, 7],
            "max_tokens": 2,
            "bootstrap_host": "203.0.113.9",
            "bootstrap_port": 1,
            "bootstrap_room": 7,
        },
    )
    assert r.status_code == 200, r.text
    # nor is an answer so far (the router's own field for a migrated request): the same greedy
    # answer as without it, never one that continues tokens the client made up
    plain = httpx.post(
        f"{routers['open']}/v1/completions", timeout=30, json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
    )
    forged = httpx.post(
        f"{routers['open']}/v1/completions",
        timeout=30,
        json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "continuation_token_ids": [9, 9]},
    )
    assert plain.status_code == forged.status_code == 200, forged.text
    assert forged.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    assert forged.json()["usage"] == plain.json()["usage"]


def test_admin_without_token_configured_is_loopback_only(routers, tiny_model):
    # the test talks over 127.0.0.1: allowed
    r = httpx.get(f"{routers['open']}/admin/workers")
    assert r.status_code == 200 and r.json()["workers"][0]["healthy"]
    bad = httpx.post(f"{routers['open']}/admin/workers", json={"url": "file:///etc/passwd", "role": "mono"})
    assert_openai_error(bad, 400)
    for url in ("http://[::1", "http://", 7):  # malformed: the caller's 400, never a 500
        assert_openai_error(httpx.post(f"{routers['open']}/admin/workers", json={"url": url, "role": "mono"}), 400)


def test_admin_with_token_refuses_without_it(routers):
    url = f"{routers['token']}/admin/workers"
    assert_openai_error(httpx.get(url), 401)
    assert_openai_error(httpx.post(url, json={"url": "http://127.0.0.1:1", "role": "mono"}), 401)
    assert_openai_error(httpx.request("DELETE", url, json={"url": routers["engine"]}), 401)
    assert_openai_error(httpx.get(url, headers={"Authorization": "Bearer wrong"}), 401)
    ok = httpx.get(url, headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200 and len(ok.json()["workers"]) == 1


def test_engine_4xx_does_not_take_the_worker_out(routers):
    for body in ({"prompt": "x", "max_tokens": 0}, {"prompt": "x", "model": "nope"}, {"prompt": [10**9]}):
        r = httpx.post(f"{routers['open']}/v1/completions", json=body, timeout=30)
        assert 400 <= r.status_code < 500, r.text
        assert "error" in r.json()
    workers = httpx.get(f"{routers['open']}/admin/workers").json()["workers"]
    assert all(w["healthy"] for w in workers), workers
    assert (
        httpx.post(
            f"{routers['open']}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=30
        ).status_code
        == 200
    )


def test_a_client_rid_neither_collides_nor_forges_a_log_line(routers):
    """Issue 39 item 9: a predictable rid made another client's request fail as a duplicate, and
    a newline in it forged router log lines."""
    import threading

    url = f"{routers['open']}/v1/completions"
    answers: list = []

    def send():
        answers.append(httpx.post(url, json={"prompt": [5, 6], "max_tokens": 24, "ignore_eos": True, "rid": "victim"}))

    threads = [threading.Thread(target=send) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [r.status_code for r in answers] == [200] * 3, [r.text for r in answers]
    ids = {r.json()["id"] for r in answers}
    assert len(ids) == 3 and all(i.startswith("victim-") for i in ids), ids
    forged = "INFO dsv4.router forged-by-a-client"
    for rid in (f"x\n{forged}", "r" * 65, 12):
        assert assert_openai_error(httpx.post(url, json={"prompt": "x", "rid": rid}), 400)["param"] == "rid"
    assert forged not in logs["router"].read_text()


def _worker_requests(router: str) -> float:
    text = httpx.get(f"{router}/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("dsv4_router:worker_requests_total{")
    )


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_whose_own_constraints_allow_no_token_is_a_4xx_sent_once(routers, stream):
    """Issue 39 item 7: the grammar allows one token, which the request also names a stop token
    that min_tokens holds back: no token is allowed. That is the request's fault: a 4xx, never a
    500 migrated to other engines (each re-prefilling and logging a traceback)."""
    url = f"{routers['open']}/v1/completions"
    probe = {"prompt": "x", "max_tokens": 4, "guided_choice": ["a"], "return_token_ids": True}
    ids = httpx.post(url, json=probe, timeout=60).json()["choices"][0]["token_ids"]
    before = _worker_requests(routers["open"])
    body = {**probe, "stop_token_ids": ids[:1], "min_tokens": 3, "stream": stream}
    body.pop("return_token_ids")
    r = httpx.post(url, json=body, timeout=60)
    if stream and r.status_code == 200:  # the refusal came after the headers: an error event
        errors = [line for line in r.text.splitlines() if line.startswith("data: {") and '"error"' in line]
        assert errors and '"code": 400' in errors[0], r.text
    else:
        assert 400 <= r.status_code < 500, r.text
    assert _worker_requests(routers["open"]) == before + 1, "sent to an engine again"
    assert httpx.get(f"{routers['open']}/admin/workers").json()["workers"][0]["healthy"]


def test_slow_clients_are_cut_off_at_the_router(routers):
    """Issue 39 item 5: a trickled header and a body that never completes hold a router
    connection no longer than --client-timeout (408 for the body)."""
    import socket
    import time

    host, port = routers["open"].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        t0, closed_after = time.monotonic(), None
        try:
            for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200:
                s.sendall(bytes([byte]))
                time.sleep(0.05)
                if time.monotonic() - t0 > 4 * CLIENT_TIMEOUT:
                    break
            closed_after = time.monotonic() - t0 if s.recv(1) == b"" else None
        except (BrokenPipeError, ConnectionResetError):
            closed_after = time.monotonic() - t0
    assert closed_after is not None and closed_after < 2 * CLIENT_TIMEOUT, closed_after
    with socket.create_connection((host, int(port)), timeout=4 * CLIENT_TIMEOUT) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        reply = s.recv(65536)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert time.monotonic() - t0 < 2 * CLIENT_TIMEOUT
    assert httpx.post(f"{routers['open']}/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_the_default_body_limit_follows_the_engines_context_length(routers):
    """Issue 39 item 4: without --max-body-bytes the router took 16 MiB bodies whatever the
    engines could hold; now 1 MiB + 32 bytes per token of their context length."""
    context = httpx.get(f"{routers['engine']}/server_info").json()["max_model_len"]
    limit = (1 << 20) + 32 * context
    assert limit < 16 << 20
    r = httpx.post(
        f"{routers['token']}/v1/completions",
        content=b'{"prompt": "' + b"a" * limit + b'"}',
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert assert_openai_error(r, 413)["code"] == "request_too_large"
    arrays = b'{"prompt": "x", "extra": [' + b",".join([b"[]"] * 70_000) + b"]}"  # under the limit
    assert len(arrays) < limit
    r = httpx.post(
        f"{routers['token']}/v1/completions", content=arrays, headers={"content-type": "application/json"}, timeout=30
    )
    assert "arrays and objects" in assert_openai_error(r, 400)["message"]
