"""API keys, per-key limits and the cache salt from the key (issue 27, item 3), on a real mono
engine started with --api-key-file behind a real router with its own keys, through the official
openai client."""

from __future__ import annotations

import hashlib
import threading

import httpx
import openai
import pytest

from bench.harness.commands import Proc, free_port

ENGINE_KEY = "engine-key-0123456789"
ALICE, BOB, CAROL = "alice-key-0123456789", "bob-key-0123456789", "carol-key-0123456789"
PROMPT = list(range(5, 70))  # 65 tokens: 4 full pages of 16


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("api-keys")
    (tmp / "engine.keys").write_text(f"# the router's key\nrouter {ENGINE_KEY}\n")
    (tmp / "router.keys").write_text(f"alice {ALICE}\nbob {BOB}\n{CAROL}\n")
    e_port, r_port = free_port(), free_port()
    engine = Proc(
        [
            "serve",
            "--model",
            tiny_model,
            "--port",
            e_port,
            "--served-model-name",
            "m",
            "--kv-pages",
            64,
            "--page-size",
            16,
            "--api-key-file",
            tmp / "engine.keys",
        ],
        tmp / "engine.log",
    )
    router = Proc(
        [
            "router",
            "--mono",
            f"http://127.0.0.1:{e_port}",
            "--port",
            r_port,
            "--health-interval",
            "0.5",
            "--api-key-file",
            tmp / "router.keys",
            "--key-max-concurrency",
            1,  # no --cache-salt-from-api-key: per-key namespaces are the default with keys (issue 39)
        ],
        tmp / "router.log",
        env={"DSV4_ENGINE_API_KEY": ENGINE_KEY},
    )
    try:
        engine.wait_ready(f"http://127.0.0.1:{e_port}")
        router.wait_ready(f"http://127.0.0.1:{r_port}")
        yield f"http://127.0.0.1:{e_port}", f"http://127.0.0.1:{r_port}"
    finally:
        router.stop()
        engine.stop()


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_the_engine_wants_a_key_on_v1_and_leaves_health_and_metrics_open(stack):
    engine, _ = stack
    for path in ("/v1/models",):
        r = httpx.get(engine + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    r = httpx.post(
        engine + "/v1/completions",
        json={"model": "m", "prompt": "hi", "max_tokens": 1},
        headers={"Authorization": "Bearer wrong"},
    )
    assert r.status_code == 401
    for path in ("/health", "/ready", "/metrics", "/v1/loads"):
        assert httpx.get(engine + path).status_code == 200, path
    assert client(engine, ENGINE_KEY).models.list().data[0].id == "m"


def test_the_router_wants_its_own_keys(stack):
    _, router = stack
    with pytest.raises(openai.AuthenticationError):
        client(router, ENGINE_KEY).completions.create(model="m", prompt="hi", max_tokens=1)
    assert httpx.get(router + "/health").status_code == 200
    r = client(router, ALICE).completions.create(model="m", prompt="hi", max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_one_key_at_its_limit_gets_429_and_the_others_do_not(stack):
    _, router = stack
    started, done = threading.Event(), threading.Event()
    held: list[int] = []

    def hold() -> None:  # alice's one allowed request, streaming until told to stop
        with httpx.stream(
            "POST",
            router + "/v1/completions",
            headers={"Authorization": f"Bearer {ALICE}"},
            timeout=120,
            json={"model": "m", "prompt": "hi", "max_tokens": 300, "ignore_eos": True, "stream": True},
        ) as r:
            held.append(r.status_code)
            for _ in r.iter_lines():
                started.set()
                if done.is_set():
                    break

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert started.wait(60) and held == [200]
        r = httpx.post(
            router + "/v1/completions",
            headers={"Authorization": f"Bearer {ALICE}"},
            json={"model": "m", "prompt": "hi", "max_tokens": 1},
            timeout=30,
        )
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "key_concurrency_limit"
        assert client(router, BOB).completions.create(model="m", prompt="hi", max_tokens=1).usage.completion_tokens == 1
    finally:
        done.set()
        t.join(60)
    metrics = httpx.get(router + "/metrics").text
    assert 'dsv4_router:key_requests_total{key="alice",result="concurrency"} 1.0' in metrics
    assert 'key="bob",result="admitted"' in metrics
    for raw in (ALICE, BOB, CAROL, ENGINE_KEY):
        assert raw not in metrics


def test_each_key_has_its_own_cache_namespace(stack):
    _, router = stack

    def cached(key: str, salt: str | None = None) -> int:
        r = client(router, key).completions.create(
            model="m", prompt=PROMPT, max_tokens=1, extra_body={"cache_salt": salt} if salt else None
        )
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached(CAROL) == 0
    assert cached(CAROL) == 64
    assert cached(BOB) == 0  # carol's prefix is not bob's to see
    # A client's own salt cannot reach another key's namespace: carol's derived salt is unknown
    # to bob, and whatever bob names stays under bob's key.
    carol_salt = "k" + hashlib.sha256(b"dsv4-cache-salt\0" + CAROL.encode()).hexdigest()[:32]
    assert cached(BOB, carol_salt) == 0
