"""`dsv4 serve` on a DeepSeek-V4 checkpoint (v4-tiny) over real HTTP: completions and chat,
streamed and not, greedy tokens equal to transformers', concurrent requests, the per-state
costs in /v1/loads and /metrics, every page and slot row back when idle; a page size the model's
compress rates do not fit refused in one line (V4 under PD: tests/integration/test_v4_pd.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from bench.harness.commands import Proc, free_port, free_port_block, serving


@pytest.fixture(scope="module")
def v4_dir(make_model):
    return make_model("v4-tiny")


@pytest.fixture(scope="module")
def server(v4_dir, tmp_path_factory):
    with serving(
        [
            "--model",
            v4_dir,
            "--kv-memory-gb",
            0.05,
            "--page-size",
            8,
            "--max-num-seqs",
            8,
            "--max-num-batched-tokens",
            13,
            "--served-model-name",
            "v4",
        ],
        tmp_path_factory.mktemp("v4") / "engine.log",
    ) as url:
        yield url


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server, timeout=60) as c:
        yield c


def sse_events(lines) -> list:
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def wait_idle(client, timeout=15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        loads = client.get("/v1/loads").json()
        if (
            loads["queues"]["running"] == 0
            and loads["queues"]["waiting"] == 0
            and loads["kv_pages_free"] == loads["kv_pages_total"]
            and loads["kv_slots_free"] == loads["kv_slots_total"]
        ):
            return loads
        assert time.monotonic() < deadline, f"engine did not return to idle: {loads}"
        time.sleep(0.05)


def test_completion_greedy_tokens_equal_transformers(client, v4_dir):
    transformers = pytest.importorskip("transformers")
    r = client.post(
        "/v1/completions",
        json={
            "prompt": "The weather today is rather odd for a Monday in late autumn",
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    prompt_ids, got = body["prompt_token_ids"], body["choices"][0]["token_ids"]
    assert len(got) == 16 and body["usage"]["completion_tokens"] == 16
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(str(v4_dir), dtype=torch.float32).eval()
    want = []
    with torch.no_grad():  # prompt in one forward, then token by token on transformers' own cache
        out = hf(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(16):
            want.append(int(out.logits[0, -1].argmax()))
            out = hf(torch.tensor([[want[-1]]]), cache=out.past_key_values, use_cache=True)
    assert got == want


def test_stream_matches_non_stream(client):
    req = {
        "prompt": "Once upon a time in a land of compressed windows",
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
    }
    full = client.post("/v1/completions", json=req).json()
    with client.stream(
        "POST", "/v1/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}}
    ) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 10
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == full["choices"][0]["text"]
    assert events[-3]["choices"][0]["finish_reason"] == "length"


def test_chat_stream_and_non_stream(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there, how are you"}]
    full = client.post(
        "/v1/chat/completions", json={"messages": msgs, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    ).json()
    assert full["object"] == "chat.completion" and full["usage"]["completion_tokens"] == 8
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={"messages": msgs, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True},
    ) as r:
        events = sse_events(r.iter_lines())
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert (
        "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
        == full["choices"][0]["message"]["content"]
    )


def test_concurrent_requests_equal_alone_and_state_returns(client):
    """Requests batched together (13-token steps split their prefills) give what each gives alone."""
    prompts = [[0] + [(7 * i + 3 * j) % 500 + 2 for j in range(n)] for i, n in enumerate([4, 9, 17, 30, 12, 25])]
    req = lambda p: {"prompt": p, "max_tokens": 9, "temperature": 0, "ignore_eos": True}  # noqa: E731
    alone = [client.post("/v1/completions", json=req(p)).json()["choices"][0]["text"] for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(
            pool.map(
                lambda p: httpx.post(f"{client.base_url}/v1/completions", json=req(p), timeout=60).json()["choices"][0][
                    "text"
                ],
                prompts,
            )
        )
    assert together == alone
    loads = wait_idle(client)
    assert loads["kv_slots_total"] == 8 and loads["kv_page_size"] == 8


def test_state_costs_in_loads_and_metrics(client):
    loads = client.get("/v1/loads").json()
    assert loads["kv_state_bytes_per_token"] == {"csa_kv": 128.0, "csa_index_k": 64.0, "hca_kv": 32.0}
    per_request = loads["kv_state_bytes_per_request"]
    assert set(per_request) == {"swa_kv", "csa_stage", "csa_index_stage", "hca_stage"} and min(per_request.values()) > 0
    text = client.get("/metrics").text
    assert 'dsv4:kv_state_bytes_per_token{model_name="v4",role="mono",state="hca_kv"} 32.0' in text
    assert (
        f'dsv4:kv_state_bytes_per_request{{model_name="v4",role="mono",state="swa_kv"}} {float(per_request["swa_kv"])}'
        in text
    )


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dsv4_cli", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


def test_bad_page_size_refused_in_one_line(v4_dir):
    for role in ("mono", "decode"):
        r = cli("serve", "--model", v4_dir, "--role", role, "--page-size", 6, "--port", free_port())
        assert r.returncode == 2, (role, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
        assert "--page-size 6" in lines[0]


def test_up_mono_serves_v4(v4_dir, tmp_path):
    """`dsv4 up --mono --model V4DIR`: router + one monolithic V4 engine, a completion through the router."""
    port = free_port_block()
    proc = Proc(
        ["up", "--mono", "--model", v4_dir, "--port", port, "--no-watchdog"],
        tmp_path / "up.log",
        env={"DSV4_CACHE": str(tmp_path / "cache"), "COLUMNS": "80"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_ready(url, timeout=120)
        deadline = time.monotonic() + 60
        while True:  # the router may be ready a moment before it has seen the engine ready
            r = httpx.post(
                f"{url}/v1/completions",
                json={"prompt": "hello v4", "max_tokens": 6, "ignore_eos": True, "temperature": 0},
                timeout=30,
            )
            if r.status_code == 200:
                break
            assert time.monotonic() < deadline, (r.status_code, r.text, proc.log())
            time.sleep(0.2)
        assert r.json()["usage"]["completion_tokens"] == 6
    finally:
        proc.stop()
