"""Hostile input against a real `dsv4 serve` (mono, tiny model) while normal traffic runs:
every hostile request gets a 4xx with an OpenAI error body, no normal request fails, the engine
stays ready. Also: logprobs, error bodies for unknown paths and methods, the body size limit,
and /health answering promptly while a multi-megabyte prompt is being tokenised."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from bench.harness.commands import serving

LIMIT = 8 * 1024 * 1024
ADMIN = {"Authorization": "Bearer hostile-admin"}
CLIENT_TIMEOUT = 2.0  # --client-timeout: headers, then the body, each within this


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with serving(
        [
            "--model",
            tiny_model,
            "--kv-pages",
            512,
            "--served-model-name",
            "tiny",
            "--max-request-bytes",
            LIMIT,
            "--admin-token",
            "hostile-admin",
            "--client-timeout",
            CLIENT_TIMEOUT,
        ],
        tmp_path_factory.mktemp("hostile") / "engine.log",
    ) as url:
        yield url


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server, timeout=60) as c:
        yield c


def assert_openai_error(r: httpx.Response, status: int | tuple = (400, 499)) -> dict:
    lo, hi = (status, status) if isinstance(status, int) else status
    assert lo <= r.status_code <= hi, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and err["type"]
    return err


def sse_events(lines) -> list:
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def deep(n: int) -> str:
    return "[" * n + "]" * n


X = '{"prompt": "x", '
# (path, body: dict | raw str, expected status) — raw strings carry what JSON dicts cannot (NaN...).
HOSTILE = [
    ("/v1/completions", X + '"temperature": NaN}', 400),
    ("/v1/completions", X + '"temperature": Infinity}', 400),
    ("/v1/completions", X + '"top_p": -Infinity}', 400),
    ("/v1/completions", X + '"temperature": 1e999}', 400),
    ("/v1/completions", X + '"stream": true, "temperature": NaN}', 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400),
    ("/v1/completions", {"prompt": [True], "max_tokens": 2}, 400),  # a JSON bool is not token id 1
    ("/v1/completions", {"prompt": [[5, False]], "max_tokens": 2}, 400),
    ("/v1/completions", {"prompt": [1.0, 2.0], "max_tokens": 2}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**30}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1.5}, 400),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, 400),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, 400),
    ("/v1/completions", {"prompt": "x", "top_k": 2**70}, 400),
    ("/v1/completions", {"prompt": "x", "seed": 2**70}, 400),
    ("/v1/completions", {"prompt": "x", "seed": -(2**70)}, 400),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400),
    ("/v1/completions", {"prompt": "x", "n": 2**70}, 400),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, 400),
    ("/v1/completions", {"prompt": "x", "logprobs": "many"}, 400),
    ("/v1/completions", {"prompt": "x", "logprobs": 2**70}, 400),
    ("/v1/completions", {"prompt": "x", "logprobs": 1, "echo": True}, 400),
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 17}, 400),
    ("/v1/completions", {"prompt": "x", "stop": ["s" * 5000]}, 400),
    ("/v1/completions", {"prompt": "x", "stop": 5}, 400),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [2**70]}, 400),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, 400),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400),
    ("/v1/completions", {"prompt": "x", "stream": "maybe"}, 400),
    ("/v1/completions", {"prompt": "x", "bootstrap_room": 2**70}, 400),
    ("/v1/completions", {"prompt": "x", "rid": "r" * 300}, 400),
    ("/v1/completions", {"prompt": "x", "rid": "a\nINFO forged log line"}, 400),  # issue 39
    ("/v1/completions", {"prompt": ["x"] * 256, "n": 16, "max_tokens": 1}, 400),  # 4,096 sequences
    ("/v1/completions", {"prompt": ["x"] * 32, "best_of": 9, "max_tokens": 1}, 400),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a{0,100000000}"}, 400),  # grammar bombs
    ("/v1/completions", {"prompt": "x", "guided_grammar": 'root ::= "a" r0\n' + "r0 ::= " + "x" * 70000}, 400),
    ("/v1/completions", {"prompt": "x", "guided_json": {"type": "string", "maxLength": 10**8}}, 400),
    ("/v1/completions", {"prompt": [2**70]}, 400),
    ("/v1/completions", {"prompt": [[]]}, 400),
    ("/v1/completions", {"prompt": {"text": "x"}}, 400),
    ("/v1/completions", {"prompt": 123}, 400),
    ("/v1/completions", X + '"extra": ' + deep(5000) + "}", 400),
    ("/v1/completions", '{"prompt": ' + deep(100000) + "}", 400),
    ("/v1/completions", "[1, 2]", 400),
    ("/v1/completions", '"just a string"', 400),
    ("/v1/completions", "", 400),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
        400,
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 123}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": {"nested": "dict"}}]}, 400),
    ("/v1/chat/completions", {"messages": [{}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "the template refuses tool messages"}]}, 400),
    ("/v1/chat/completions", {"messages": [123]}, 400),
    ("/v1/chat/completions", {"messages": "hello"}, 400),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 5}, 400),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
        400,
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": "yes please"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 2**2000}, 400),
]
# Extreme but within the documented ranges: served, and harmless to their batch neighbours.
EXTREME_VALID = [
    {"prompt": "x", "max_tokens": 4, "temperature": 1e-30},
    {"prompt": "x", "max_tokens": 4, "temperature": 1e30},
    {"prompt": "x", "max_tokens": 4, "top_p": 1e-300},
    {"prompt": "x", "max_tokens": 4, "top_k": 10**18, "temperature": 1.0},
    {"prompt": "x", "max_tokens": 4, "seed": 2**63 - 1, "temperature": 0.7},
    {"prompt": "x", "max_tokens": 4, "seed": -(2**63), "temperature": 0.7},
    {"prompt": "x", "max_tokens": 4, "logprobs": 20, "temperature": 5.0},
]


def post(c: httpx.Client, path: str, body) -> httpx.Response:
    if isinstance(body, (str, bytes)):
        return c.post(path, content=body, headers={"content-type": "application/json"})
    return c.post(path, json=body)


class NormalTraffic:
    """Good requests, streaming and not, in a few threads, until stopped; every failure kept."""

    def __init__(self, url: str, threads: int = 3):
        self.url, self.stop, self.ok, self.failures = url, threading.Event(), 0, []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(i,)) for i in range(threads)]

    def run(self, i: int) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as c:
            n = 0
            while not self.stop.is_set():
                n += 1
                body = {
                    "prompt": f"normal request {i} {n}",
                    "max_tokens": 12,
                    "ignore_eos": True,
                    "temperature": 0.8 if n % 2 else 0,
                    "seed": n,
                    "logprobs": 2 if n % 3 == 0 else None,
                }
                try:
                    if n % 2:
                        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                            events = sse_events(r.iter_lines()) if r.status_code == 200 else None
                        good = (
                            r.status_code == 200
                            and events[-1] == "[DONE]"
                            and events[-2]["choices"][0]["finish_reason"] == "length"
                        )
                        detail = (r.status_code, events[-3:] if events else None)
                    else:
                        r = c.post("/v1/completions", json=body)
                        good = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12
                        detail = (r.status_code, r.text[:300])
                except httpx.HTTPError as e:
                    good, detail = False, repr(e)
                with self.lock:
                    if good:
                        self.ok += 1
                    else:
                        self.failures.append(detail)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(120)


def check_bodies_over_the_limit_are_413(server: str, client: httpx.Client) -> None:
    # Declared too large: refused before the body is read.
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: %d\r\n\r\n{"prompt": "' % (LIMIT + 1)
        )
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert json.loads(body)["error"]["code"] == "request_too_large"

    # Chunked, no length: refused once it outgrows the limit.
    def chunks():
        yield b'{"prompt": "'
        for _ in range(LIMIT // 65536 + 1):
            yield b"a" * 65536
        yield b'"}'

    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(r, 413)


def test_hostile_matrix_under_normal_traffic(server, client):
    with NormalTraffic(server) as traffic:
        for path, body, status in HOSTILE:
            r = post(client, path, body)
            assert_openai_error(r, status)
            # A 4xx never marks the engine unready.
            assert client.get("/ready").status_code == 200
        check_bodies_over_the_limit_are_413(server, client)
        assert client.get("/ready").status_code == 200
        for body in EXTREME_VALID:
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, (body, r.text[:300])
            assert r.json()["usage"]["completion_tokens"] >= 1
        # Keep the normal traffic going a little after the last hostile request.
        deadline = time.monotonic() + 60
        start_ok = traffic.ok
        while traffic.ok < start_ok + 6 and time.monotonic() < deadline:
            time.sleep(0.05)
    print(
        f"{len(HOSTILE)} hostile + {len(EXTREME_VALID)} extreme-valid requests; {traffic.ok} normal requests, "
        f"{len(traffic.failures)} failed"
    )
    assert traffic.failures == [], traffic.failures[:5]
    assert traffic.ok >= 6
    assert client.get("/ready").status_code == 200
    loads = client.get("/v1/loads", headers=ADMIN).json()
    deadline = time.monotonic() + 10
    while loads["kv_pages_free"] != loads["kv_pages_total"] and time.monotonic() < deadline:
        time.sleep(0.05)
        loads = client.get("/v1/loads", headers=ADMIN).json()
    assert loads["kv_pages_free"] == loads["kv_pages_total"]


def test_unknown_path_wrong_method_bad_admin_body_are_openai_errors(client):
    assert_openai_error(client.get("/v1/nothing-here"), 404)
    assert_openai_error(client.post("/v1/embeddings", json={}), 404)
    assert_openai_error(client.get("/v1/completions"), 405)
    assert_openai_error(client.delete("/v1/chat/completions"), 405)
    assert_openai_error(client.post("/admin/abort", content=b"[" * 5000, headers=ADMIN), 400)


def test_completion_logprobs(client):
    req = {"prompt": "The weather today is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    plain = client.post("/v1/completions", json=req).json()
    assert plain["choices"][0]["logprobs"] is None
    body = client.post("/v1/completions", json={**req, "logprobs": 3}).json()
    choice = body["choices"][0]
    assert choice["text"] == plain["choices"][0]["text"]  # asking for logprobs changes nothing else
    lp = choice["logprobs"]
    n = body["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    for tok, tlp, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert tlp <= 0 and 3 <= len(top) <= 4
        assert top[tok] == tlp and tlp == pytest.approx(max(top.values()))  # greedy: the sampled is the best
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0

    with client.stream("POST", "/v1/completions", json={**req, "logprobs": 3, "stream": True}) as r:
        events = sse_events(r.iter_lines())
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in events[:-1]:
        for k in streamed:
            streamed[k] += e["choices"][0]["logprobs"][k]
    assert streamed["tokens"] == lp["tokens"] and streamed["text_offset"] == lp["text_offset"]
    assert streamed["token_logprobs"] == pytest.approx(lp["token_logprobs"])

    zero = client.post("/v1/completions", json={**req, "logprobs": 0}).json()["choices"][0]["logprobs"]
    assert all(list(top) == [tok] for tok, top in zip(zero["tokens"], zero["top_logprobs"]))


def test_chat_logprobs(client):
    req = {
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }
    assert client.post("/v1/chat/completions", json=req).json()["choices"][0]["logprobs"] is None
    body = client.post("/v1/chat/completions", json={**req, "logprobs": True, "top_logprobs": 2}).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] == 6
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        if item["token"].startswith("bytes:"):  # part of a UTF-8 character
            assert item["token"] == "bytes:" + "".join(f"\\x{b:02x}" for b in item["bytes"])
        else:
            assert item["bytes"] == list(item["token"].encode())
        assert len(item["top_logprobs"]) == 2 and item["top_logprobs"][0]["logprob"] == pytest.approx(item["logprob"])
    only = client.post("/v1/chat/completions", json={**req, "logprobs": True}).json()["choices"][0]["logprobs"][
        "content"
    ]
    assert [i["token"] for i in only] == [i["token"] for i in content] and all(i["top_logprobs"] == [] for i in only)
    with client.stream(
        "POST", "/v1/chat/completions", json={**req, "logprobs": True, "top_logprobs": 2, "stream": True}
    ) as r:
        events = sse_events(r.iter_lines())
    streamed = [i for e in events[1:-1] for i in (e["choices"][0]["logprobs"] or {"content": []})["content"]]
    assert [i["token"] for i in streamed] == [i["token"] for i in content]


def test_health_answers_while_huge_prompts_are_processed(server, client):
    """Multi-megabyte prompts (text, token ids, chat) are parsed, tokenised and refused off the
    event loop: /health and /ready keep answering promptly meanwhile."""
    text = "the quick brown fox jumps over the lazy dog. " * (7 * 1024 * 1024 // 45)  # ~7 MB, under the limit
    bodies = [
        ("/v1/completions", {"prompt": text, "max_tokens": 1}),
        ("/v1/completions", {"prompt": [7] * 1_000_000, "max_tokens": 1}),  # ~3 MB of token ids
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text[: 5 * 1024 * 1024]}]}),
        ("/v1/completions", {"prompt": text[:40_000], "max_tokens": 1}),
    ]  # tokenised in full
    results: dict = {}

    def big(i, path, body):
        with httpx.Client(base_url=server, timeout=120) as c:
            results[i] = c.post(path, json=body)

    threads = [threading.Thread(target=big, args=(i, *pb)) for i, pb in enumerate(bodies)]
    for t in threads:
        t.start()
    worst, polls = 0.0, 0
    while any(t.is_alive() for t in threads):
        t0 = time.monotonic()
        assert client.get("/health").status_code == 200
        assert client.get("/ready").status_code == 200
        worst = max(worst, time.monotonic() - t0)
        polls += 1
        time.sleep(0.02)
    for t in threads:
        t.join()
    for i in range(len(bodies)):
        assert assert_openai_error(results[i], 400)["code"] == "context_length_exceeded"
    assert polls >= 3, polls
    print(f"worst /health+/ready latency {worst:.3f}s over {polls} polls")
    # Bounded with room for a loaded CI machine; tokenising the 7 MB text alone on the event loop
    # stalled it for 10+ s before.
    assert worst < 2.0, f"/health+/ready took {worst:.2f}s while multi-megabyte prompts were processed"


def raw_exchange(server: str, head: bytes, wait: float) -> tuple[bytes, float]:
    """Send `head` on a new connection, then read what comes back (until the server closes or
    `wait` passes): (the reply, seconds until the server answered or closed)."""
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as s:
        t0 = time.monotonic()
        s.sendall(head)
        reply = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                reply += chunk
                if b"\r\n\r\n" in reply and reply.rstrip().endswith(b"}"):
                    break
        except socket.timeout:
            pass
        return reply, time.monotonic() - t0


def test_slow_clients_are_cut_off_while_others_are_served(server, client):
    """Issue 39 item 5: headers that trickle in, and a body that never completes, hold a
    connection no longer than --client-timeout; others are served meanwhile."""
    host, port = server.removeprefix("http://").split(":")
    trickler = socket.create_connection((host, int(port)), timeout=10)
    t0, closed_after = time.monotonic(), None
    try:
        for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200:
            trickler.sendall(bytes([byte]))
            r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert r.status_code == 200
            time.sleep(0.05)
            if time.monotonic() - t0 > 4 * CLIENT_TIMEOUT:
                break
    except (BrokenPipeError, ConnectionResetError):
        closed_after = time.monotonic() - t0
    finally:
        trickler.close()
    assert closed_after is not None and closed_after < 2 * CLIENT_TIMEOUT, closed_after
    reply, took = raw_exchange(
        server,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"prompt": "',
        wait=4 * CLIENT_TIMEOUT,
    )
    assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply, reply[:300]
    assert took < 2 * CLIENT_TIMEOUT
    assert client.get("/ready").status_code == 200


def test_unauthenticated_admin_bodies_are_refused_before_they_are_read(server):
    """Issue 39 item 5: a caller without the admin token declared a 16 MiB body and was waited
    for while the engine buffered it; now it is refused at the headers."""
    for path in ("/admin/abort", "/admin/drain"):
        reply, took = raw_exchange(
            server,
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
            + b"Content-Length: 8000000\r\n\r\n",
            wait=CLIENT_TIMEOUT / 2,
        )
        assert reply.startswith(b"HTTP/1.1 401"), (path, reply[:200], took)
