"""Prefill/decode over real NIXL between real processes, behind the real router.

PD output must equal monolithic output token for token; every injected fault must end its
request within its deadline (or be retried), return every page on both sides and move the
right counter; and with deadlines off, a stalled transfer must reproduce the wedge.
"""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest

from bench.harness.commands import Proc, free_port

BOOTSTRAP_TIMEOUT, TRANSFER_TIMEOUT, WAITING_TIMEOUT = 4.0, 3.0, 5.0
SLACK = 6.0  # scheduling noise on two busy cores, plus one retry's prefill


class PDCluster:
    def __init__(self, model, tmp, *, prefill_args=(), decode_args=(), mono_args=()):
        self.model, self.tmp = model, tmp
        self.procs: list[Proc] = []
        self.p_port, self.b_port, self.d_port, self.m_port, self.r_port = (free_port() for _ in range(5))
        self.prefill = self._start(
            "prefill",
            [
                "--port",
                self.p_port,
                "--bootstrap-port",
                self.b_port,
                "--transfer-timeout",
                TRANSFER_TIMEOUT,
                *prefill_args,
            ],
        )
        self.decode = self._start("decode", ["--port", self.d_port, "--waiting-timeout", WAITING_TIMEOUT, *decode_args])
        self.mono = self._start("mono", ["--port", self.m_port, *mono_args])
        self.router = Proc(
            [
                "router",
                "--prefill",
                self.p_url,
                "--decode",
                self.d_url,
                "--port",
                self.r_port,
                "--health-interval",
                "0.5",
            ],
            tmp / "router.log",
        )
        self.procs.append(self.router)
        for url, proc in [
            (self.p_url, self.prefill),
            (self.d_url, self.decode),
            (self.m_url, self.mono),
            (self.r_url, self.router),
        ]:
            proc.wait_ready(url)

    def _start(self, role, args) -> Proc:
        p = Proc(
            [
                "serve",
                "--model",
                self.model,
                "--role",
                role,
                "--kv-pages",
                128,
                "--page-size",
                16,
                "--bootstrap-timeout",
                BOOTSTRAP_TIMEOUT,
                "--enable-fault-injection",
                "--served-model-name",
                "m",
                *args,
            ],
            self.tmp / f"{role}-{len(self.procs)}.log",
        )
        self.procs.append(p)
        return p

    def restart_decode(self) -> None:
        self.decode.stop()
        self.decode = self._start("decode", ["--port", self.d_port, "--waiting-timeout", WAITING_TIMEOUT])
        self.decode.wait_ready(self.d_url)

    p_url = property(lambda self: f"http://127.0.0.1:{self.p_port}")
    d_url = property(lambda self: f"http://127.0.0.1:{self.d_port}")
    m_url = property(lambda self: f"http://127.0.0.1:{self.m_port}")
    r_url = property(lambda self: f"http://127.0.0.1:{self.r_port}")

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


@pytest.fixture(scope="module", params=["tiny", "mla512"])
def cluster(request, make_model, tmp_path_factory):
    c = PDCluster(make_model(request.param), tmp_path_factory.mktemp(f"pd-{request.param}"))
    yield c
    c.stop()


def complete(url: str, prompt, max_tokens: int = 16, **extra) -> dict:
    r = httpx.post(
        f"{url}/v1/completions",
        json={
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            **extra,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def loads(url: str) -> dict:
    return httpx.get(f"{url}/v1/loads", timeout=5).json()


def wait_pages_back(*urls: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    for url in urls:
        while True:
            ld = loads(url)
            busy = sum(v for k, v in ld["queues"].items())
            if ld["kv_pages_free"] == ld["kv_pages_total"] and busy == 0:
                break
            assert time.monotonic() < deadline, f"{url} still holds pages: {ld}"
            time.sleep(0.05)


def arm(url: str, fault: str, count: int = 1, **params) -> None:
    r = httpx.post(f"{url}/admin/faults", json={"fault": fault, "count": count, **params}, timeout=5)
    assert r.status_code == 200, r.text


def test_pd_equals_mono_for_concurrent_staggered_requests(cluster):
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 500) for _ in range(rng.randint(3, 90))] for _ in range(8)]
    results: dict[int, dict] = {}

    def one(i):
        time.sleep(0.05 * i)  # staggered arrivals join running batches
        results[i] = complete(cluster.r_url, prompts[i], max_tokens=12 + i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for i, p in enumerate(prompts):
        mono = complete(cluster.m_url, p, max_tokens=12 + i)
        assert results[i]["choices"][0]["token_ids"] == mono["choices"][0]["token_ids"], i
    wait_pages_back(cluster.p_url, cluster.d_url)
    assert loads(cluster.p_url)["counters"]["kv_transfers_completed"] >= len(prompts)


def test_multi_round_conversation_with_growing_context(cluster):
    rng = random.Random(5)
    history: list[int] = []
    for round_ in range(4):
        history += [rng.randrange(2, 500) for _ in range(20 + 10 * round_)]  # the user's turn
        pd = complete(cluster.r_url, history, max_tokens=16)
        mono = complete(cluster.m_url, history, max_tokens=16)
        assert pd["choices"][0]["token_ids"] == mono["choices"][0]["token_ids"], round_
        history += pd["choices"][0]["token_ids"]
    assert len(history) > 150


def _counter(url: str, name: str) -> float:
    return loads(url)["counters"][name]


@pytest.mark.parametrize(
    "fault,counter_url,counter,bound",
    [
        ("stall_transfer", "p", "num_transfer_timeout_reqs", TRANSFER_TIMEOUT),
        ("fail_transfer", "p", "num_transfer_failed_reqs", 0.0),
        ("drop_notification", "d", "num_transfer_timeout_reqs", WAITING_TIMEOUT),
    ],
)
def test_fault_fails_within_deadline_then_router_retries(cluster, fault, counter_url, counter, bound):
    url = {"p": cluster.p_url, "d": cluster.d_url}[counter_url]
    before = _counter(url, counter)
    arm(cluster.p_url, fault)
    prompt = list(range(10, 60))
    t0 = time.monotonic()
    out = complete(cluster.r_url, prompt, max_tokens=8)  # the router's retry succeeds
    elapsed = time.monotonic() - t0
    assert elapsed < bound + SLACK, f"{fault}: took {elapsed:.1f}s"
    assert out["choices"][0]["token_ids"] == complete(cluster.m_url, prompt, max_tokens=8)["choices"][0]["token_ids"]
    assert _counter(url, counter) == before + 1
    wait_pages_back(cluster.p_url, cluster.d_url)
    router_metrics = httpx.get(f"{cluster.r_url}/metrics").text
    assert "dsv4_router:retries_total" in router_metrics


def test_fault_without_router_gives_the_client_a_clear_error(cluster):
    """Talking to a pair directly (no retry), a failed transfer is an error, not a hang."""
    arm(cluster.p_url, "fail_transfer")
    body = {
        "prompt": list(range(5, 40)),
        "max_tokens": 4,
        "temperature": 0,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": cluster.b_port,
        "bootstrap_room": 424242,
    }
    res = {}
    t = threading.Thread(
        target=lambda: res.update(p=httpx.post(f"{cluster.p_url}/v1/completions", json=body, timeout=60))
    )
    t.start()
    d = httpx.post(f"{cluster.d_url}/v1/completions", json=body, timeout=60)
    t.join(60)
    assert res["p"].status_code == 502 and "injected fault" in res["p"].json()["error"]["message"]
    assert d.status_code == 502 and "prefill failed" in d.json()["error"]["message"]
    wait_pages_back(cluster.p_url, cluster.d_url)


def test_delayed_bootstrap_still_succeeds(cluster):
    arm(cluster.p_url, "delay_bootstrap", seconds=1.0)
    t0 = time.monotonic()
    out = complete(cluster.r_url, [7, 8, 9, 10], max_tokens=4)
    assert time.monotonic() - t0 >= 0.9
    assert len(out["choices"][0]["token_ids"]) == 4


def test_engine_requests_need_the_router(cluster):
    r = httpx.post(f"{cluster.d_url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 400 and "router" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "body,status",
    [
        (b"{nope", 400),
        (b"[1, 2]", 400),
    ],
)
def test_router_rejects_malformed_bodies(cluster, body, status):
    r = httpx.post(f"{cluster.r_url}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status and "error" in r.json()


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x", "max_tokens": 0},
        {"prompt": "x", "model": "nope"},
        {"prompt": "x", "max_tokens": 100000},
        {"prompt": "x", "temperature": -2},
    ],
)
def test_router_bad_input_matches_the_engine(cluster, body):
    via_router = httpx.post(f"{cluster.r_url}/v1/completions", json=body, timeout=30)
    direct = httpx.post(f"{cluster.m_url}/v1/completions", json=body, timeout=30)
    assert via_router.status_code == direct.status_code and 400 <= direct.status_code < 500
    assert via_router.json()["error"]["message"] == direct.json()["error"]["message"]
    wait_pages_back(cluster.p_url, cluster.d_url)


def test_a_list_of_prompts_through_pd_answers_each_as_alone(cluster):
    """Several prompts in one PD request: each sequence gets its own bootstrap room (derived from
    the router's on both engines), so each has its own hand-off and answers as if sent alone."""
    prompts, body = [[5, 6, 7], [8, 9]], {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{cluster.r_url}/v1/completions", json={"prompt": prompts, **body}, timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()
    alone = [
        httpx.post(f"{cluster.r_url}/v1/completions", json={"prompt": p, **body}, timeout=60).json() for p in prompts
    ]
    assert [c["index"] for c in got["choices"]] == [0, 1]
    assert [c["text"] for c in got["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert got["usage"]["prompt_tokens"] == 5 and got["usage"]["completion_tokens"] == 6
    wait_pages_back(cluster.p_url, cluster.d_url)


def test_stream_with_usage_through_router(cluster):
    """stream_options belong to the streaming decode leg only: the prefill leg is not streamed,
    and an engine refuses stream_options without stream (it once failed every such request)."""
    body = {
        "prompt": list(range(3, 30)),
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.monotonic()
    with httpx.stream("POST", f"{cluster.r_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]" and time.monotonic() - t0 < WAITING_TIMEOUT
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 5


def test_stream_through_router_and_client_disconnect(cluster):
    prompt = list(range(3, 30))
    with httpx.stream(
        "POST",
        f"{cluster.r_url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "stream": True},
        timeout=60,
    ) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    before = _counter(cluster.d_url, "num_aborted_reqs")
    with httpx.stream(
        "POST",
        f"{cluster.r_url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 1000, "ignore_eos": True, "stream": True},
        timeout=60,
    ) as r:
        for ln in r.iter_lines():
            if ln.startswith("data: "):
                break
    wait_pages_back(cluster.p_url, cluster.d_url)
    assert _counter(cluster.d_url, "num_aborted_reqs") == before + 1


def test_wedge_reproduced_with_deadlines_disabled(cluster):
    """The production wedge on purpose: deadlines off + a stalled transfer = stuck forever."""
    for url in (cluster.p_url, cluster.d_url):
        arm(url, "disable_deadlines", -1)
    arm(cluster.p_url, "stall_transfer")
    body = {
        "prompt": list(range(20, 70)),
        "max_tokens": 4,
        "temperature": 0,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": cluster.b_port,
        "bootstrap_room": 777,
    }
    threads = [
        threading.Thread(target=lambda u=u: httpx.post(f"{u}/v1/completions", json=body, timeout=60))
        for u in (cluster.p_url, cluster.d_url)
    ]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 20
        while loads(cluster.p_url)["queues"]["inflight"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        ages = []
        for _ in range(3):
            time.sleep(TRANSFER_TIMEOUT / 2 + 0.5)
            ld = loads(cluster.p_url)
            assert ld["queues"]["inflight"] == 1
            ages.append(ld["prefill_inflight_oldest_age_seconds"])
        assert ages[0] < ages[1] < ages[2] and ages[2] > TRANSFER_TIMEOUT + 1  # well past the deadline it no longer has
        metrics = httpx.get(f"{cluster.p_url}/metrics").text
        assert 'dsv4:num_prefill_inflight_queue_reqs{model_name="m",role="prefill"} 1.0' in metrics
    finally:
        for url in (cluster.p_url, cluster.d_url):
            httpx.delete(f"{url}/admin/faults")
        httpx.post(f"{cluster.p_url}/admin/abort", json={"all": True})  # what the operator does
        for t in threads:
            t.join(30)
    wait_pages_back(cluster.p_url, cluster.d_url)


def crash_decode_mid_transfer(cluster, room: int, slack: float) -> None:
    """Decode's engine core exits while prefill holds the request in its inflight queue (a stalled
    transfer): decode's HTTP process answers with a 5xx (or, had the whole process gone, the
    connection drops), never a hang, and prefill fails the request within its transfer deadline."""
    arm(cluster.d_url, "crash")
    arm(cluster.p_url, "stall_transfer")
    body = {
        "prompt": list(range(30, 80)),
        "max_tokens": 4,
        "temperature": 0,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": cluster.b_port,
        "bootstrap_room": room,
    }
    res = {}
    t = threading.Thread(
        target=lambda: res.update(p=httpx.post(f"{cluster.p_url}/v1/completions", json=body, timeout=60))
    )
    t.start()
    try:
        r = httpx.post(f"{cluster.d_url}/v1/completions", json=body, timeout=60)
        assert r.status_code >= 500 and "engine process exited" in r.text, r.text
    except httpx.HTTPError:
        pass
    t0 = time.monotonic()
    t.join(TRANSFER_TIMEOUT + slack)
    assert not t.is_alive() and res["p"].status_code >= 500
    assert time.monotonic() - t0 < TRANSFER_TIMEOUT + slack


def test_decode_crash_empties_prefill_inflight_and_traffic_recovers(cluster):
    crash_decode_mid_transfer(cluster, room=999, slack=SLACK)
    wait_pages_back(cluster.p_url)
    cluster.restart_decode()
    deadline = time.monotonic() + 20
    while True:  # the router notices the new decode at its next health check
        r = httpx.post(
            f"{cluster.r_url}/v1/completions",
            json={"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True},
            timeout=60,
        )
        if r.status_code == 200:
            break
        assert time.monotonic() < deadline, r.text
        time.sleep(0.5)
    assert r.json()["usage"]["completion_tokens"] == 3


def test_client_giving_up_on_a_non_streamed_request_aborts_it(cluster):
    before = _counter(cluster.d_url, "num_aborted_reqs")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{cluster.r_url}/v1/completions",
            json={"prompt": [4, 5, 6], "max_tokens": 1500, "ignore_eos": True},
            timeout=httpx.Timeout(60, read=1.0),
        )
    wait_pages_back(cluster.p_url, cluster.d_url)
    assert _counter(cluster.d_url, "num_aborted_reqs") == before + 1
