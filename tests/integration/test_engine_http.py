"""The monolithic engine over real HTTP: every endpoint, streaming, bad input, aborts."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from bench.harness.commands import serving

TOKEN = "sekret"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with serving(
        ["--model", tiny_model, "--kv-pages", 256, "--admin-token", TOKEN, "--served-model-name", "tiny"],
        tmp_path_factory.mktemp("mono") / "engine.log",
    ) as url:
        yield url


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server, timeout=60) as c:
        yield c


def sse_events(lines) -> list:
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def wait_idle(client, timeout=10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        loads = client.get("/v1/loads", headers=ADMIN).json()
        idle = loads["queues"]["running"] == 0 and loads["queues"]["waiting"] == 0
        if idle and loads["kv_pages_free"] == loads["kv_pages_total"]:
            return loads
        assert time.monotonic() < deadline, f"engine did not return to idle: {loads}"
        time.sleep(0.05)


def test_models_health_ready(client):
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny"
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").status_code == 200


def test_completion_text_and_token_ids(client):
    r = client.post(
        "/v1/completions",
        json={
            "model": "tiny",
            "prompt": "The weather today is",
            "max_tokens": 12,
            "temperature": 0,
            "return_token_ids": True,
            "some_unknown_field": 1,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert body["object"] == "text_completion"
    assert len(choice["token_ids"]) == body["usage"]["completion_tokens"] <= 12
    assert body["usage"]["prompt_tokens"] == len(body["prompt_token_ids"])
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    # The same prompt given as token ids yields the same greedy tokens.
    r2 = client.post(
        "/v1/completions",
        json={"prompt": body["prompt_token_ids"], "max_tokens": 12, "temperature": 0, "return_token_ids": True},
    ).json()
    assert r2["choices"][0]["token_ids"] == choice["token_ids"]
    assert r2["choices"][0]["text"] == choice["text"]


def test_batch_of_prompts(client):
    r = client.post(
        "/v1/completions",
        json={
            "prompt": ["one", "two words", "three words here"],
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 12


def test_stream_matches_non_stream_and_reports_usage(client):
    req = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    full = client.post("/v1/completions", json=req).json()
    with client.stream(
        "POST", "/v1/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}}
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    text = "".join(e["choices"][0]["text"] for e in events[:-2])
    assert text == full["choices"][0]["text"]
    assert events[-3]["choices"][0]["finish_reason"] == "length"


def test_chat_stream_and_non_stream(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    full = client.post(
        "/v1/chat/completions", json={"messages": msgs, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    ).json()
    assert full["object"] == "chat.completion"
    assert full["choices"][0]["message"]["role"] == "assistant"
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={"messages": msgs, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True},
    ) as r:
        events = sse_events(r.iter_lines())
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == full["choices"][0]["message"]["content"]
    assert full["usage"]["completion_tokens"] == 8


def test_stop_string_and_seeded_sampling(client):
    base = client.post(
        "/v1/completions", json={"prompt": "The", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    ).json()
    text = base["choices"][0]["text"]
    stop = text[4:7]
    assert stop.strip(), f"need a visible stop string in {text!r}"
    cut = client.post(
        "/v1/completions",
        json={"prompt": "The", "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": [stop]},
    ).json()
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["text"] == text[: text.index(stop)]
    sampled = {"prompt": "The", "max_tokens": 16, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 7}
    a = client.post("/v1/completions", json=sampled).json()["choices"][0]["text"]
    b = client.post("/v1/completions", json=sampled).json()["choices"][0]["text"]
    assert a == b


@pytest.mark.parametrize(
    "body,status,needle",
    [
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"prompt": "x", "top_k": -5}, 400, "top_k"),
        ({"prompt": "x", "n": 17}, 400, "less than or equal to 16"),
        ({"prompt": ""}, 400, "empty"),
        ({"prompt": [1, 2, 99999]}, 400, "out of range"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "does not exist"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": "x", "max_tokens": 1_000_000}, 400, "maximum context length"),
        ({"prompt": list(range(5, 505)) * 5}, 400, "maximum context length"),
        ({"prompt": "x", "stop": [""]}, 400, "stop"),
    ],
)
def test_bad_input_is_a_4xx_with_openai_body(client, body, status, needle):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]


def test_malformed_json_and_bad_chat(client):
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = client.post("/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    assert client.get("/health").status_code == 200
    wait_idle(client)


def test_metrics_have_every_contract_name_with_labels(client):
    text = client.get("/metrics").text
    from prometheus_client.parser import text_string_to_metric_families

    names = {
        s.name
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.labels.get("role") == "mono" and s.labels.get("model_name") == "tiny"
    }
    for g in [
        "num_running_reqs",
        "num_queue_reqs",
        "num_prefill_bootstrap_queue_reqs",
        "num_prefill_inflight_queue_reqs",
        "num_decode_prealloc_queue_reqs",
        "num_decode_transfer_queue_reqs",
        "prefill_inflight_oldest_age_seconds",
        "kv_pages_free",
        "kv_pages_total",
    ]:
        assert f"dsv4:{g}" in names, g
    for c in [
        "num_bootstrap_failed_reqs",
        "num_transfer_failed_reqs",
        "num_transfer_timeout_reqs",
        "kv_transfers_completed",
        "kv_transfer_bytes",
        "prompt_tokens",
        "generation_tokens",
        "num_aborted_reqs",
        "scheduler_loop_iterations",
    ]:
        assert f"dsv4:{c}_total" in names, c
    for h in [
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "kv_transfer_latency_seconds",
    ]:
        assert f"dsv4:{h}_bucket" in names, h


def test_client_disconnect_aborts_and_frees_pages(client, server):
    before = client.get("/v1/loads", headers=ADMIN).json()["counters"]["num_aborted_reqs"]
    with httpx.Client(base_url=server, timeout=30) as other:
        with other.stream(
            "POST",
            "/v1/completions",
            json={"prompt": "a long story", "max_tokens": 1500, "ignore_eos": True, "stream": True},
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # one chunk, then hang up
    loads = wait_idle(client)
    assert loads["counters"]["num_aborted_reqs"] == before + 1
    # nothing left counted as waiting on the HTTP side (the watchdog's clients_waiting_idle reads it)
    assert loads["http_waiting"] == 0
    assert 'dsv4:num_http_waiting_reqs{model_name="tiny",role="mono"} 0' in client.get("/metrics").text


def test_admin_abort_and_token(client, server):
    assert client.post("/admin/abort", json={"all": True}).status_code == 401
    assert client.get("/debug/stacks").status_code == 401
    stacks = client.get("/debug/stacks", headers=ADMIN).text
    assert "dsv4-engine" in stacks
    import threading

    result = {}

    def long_request():
        with httpx.Client(base_url=server, timeout=60) as c:
            result["r"] = c.post(
                "/v1/completions", json={"prompt": "tell me", "max_tokens": 1500, "ignore_eos": True, "rid": "victim"}
            )

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 20
    while client.get("/v1/loads", headers=ADMIN).json()["queues"]["running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert client.post("/admin/abort", json={"rid": "victim"}, headers=ADMIN).status_code == 200
    t.join(20)
    r = result["r"]
    assert r.status_code >= 400 and "aborted" in r.json()["error"]["message"]
    wait_idle(client)
    assert client.post("/admin/abort", json={"nothing": 1}, headers=ADMIN).status_code == 400


def readme_quick_start() -> tuple[dict, str]:
    """The README's quick-start curl body and its `openai` client example (issue 43)."""
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (curl,) = [line for line in text.splitlines() if line.startswith("curl http://127.0.0.1:8000/v1/chat/completions")]
    argv = shlex.split(curl)
    body = json.loads(argv[argv.index("-d") + 1])
    (python,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return body, python


def test_the_readme_quick_start_works_as_written(server, client, capsys):
    """Its curl body and its openai example, run as written (the URL pointed at this engine)."""
    body, python = readme_quick_start()
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    assert "http://127.0.0.1:8000/v1" in python
    exec(compile(python.replace("http://127.0.0.1:8000/v1", server + "/v1"), "README.md", "exec"), {})
    assert capsys.readouterr().out.strip()


def test_drain_makes_ready_fail(client):
    # Last in this module: draining is one-way.
    assert client.post("/admin/drain", headers=ADMIN).json() == {"draining": True}
    r = client.get("/ready")
    assert r.status_code == 503 and r.json()["reason"] == "draining"
    assert client.get("/health").status_code == 200
