"""The host tier over HTTP (issue 41, item 3), a real tiny engine and the official openai client:
six conversations through a 14-page pool, their second rounds find the first rounds' pages in
the host tier (cached_tokens, per-tier loads and KV events); `kill -9` of the engine (both
processes) loses nothing but cache: the engine restarted on the same port serves the same
answers, from an empty cache, and its events stream starts afresh (a new instance, nothing held)."""

from __future__ import annotations

import os
import signal

import httpx
import openai
import pytest

from bench.harness.commands import Proc, free_port
from dsv4_wire import kv_events as wire

PAGE = 16


def prompt(k: int) -> list[int]:
    return [(31 * k + 5 * i) % 400 + 20 for i in range(4 * PAGE + 3)]


def snapshot(url: str) -> dict:
    with httpx.stream("GET", url + "/v1/kv_events", timeout=20) as r:
        for line in r.iter_lines():
            if line.strip():
                return wire.decode(line)
    raise AssertionError("no snapshot")


@pytest.mark.slow  # two engine starts (~9 s); the tier's behaviour is in the default run's unit tests
def test_pages_come_back_from_host_memory_and_kill_9_loses_only_cache(tiny_model, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["serve", "--model", tiny_model, "--kv-pages", 14, "--page-size", PAGE, "--served-model-name", "m"]
    args += ["--max-num-seqs", 2, "--host-cache-gb", 0.01, "--port", port]

    def start(n: int) -> Proc:
        p = Proc(args, tmp_path / f"serve{n}.log")
        p.wait_ready(url)
        return p

    def ask(client: openai.OpenAI, k: int) -> tuple[str, int]:
        r = client.completions.create(model="m", prompt=prompt(k), max_tokens=4, temperature=0)
        return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens

    engine = start(0)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        first = [ask(client, k) for k in range(6)]
        second = [ask(client, k) for k in range(6)]
        assert [t for t, _ in second] == [t for t, _ in first]
        assert all(c == 4 * PAGE for _, c in second), second  # a 14-page pool holds 3 of the 6
        host = httpx.get(url + "/v1/loads").json()["prefix_cache"]["tiers"]["host"]
        assert host["restored"] > 0 and host["hit_tokens"] >= 3 * 4 * PAGE
        snap = snapshot(url)
        assert snap["tiers"]["host"] and snap["tiers"]["device"]
        assert (
            'dsv4:prefix_cache_tier_hit_tokens_total{model_name="m",role="mono",tier="host"}'
            in httpx.get(url + "/metrics").text
        )

        os.killpg(engine.popen.pid, signal.SIGKILL)
        engine.popen.wait(10)
        engine = start(1)
        fresh = snapshot(url)
        assert fresh["instance"] != snap["instance"] and fresh["seq"] == 1
        assert all(not hs for hs in fresh["tiers"].values())
        again = [ask(client, k) for k in range(6)]
        assert [t for t, _ in again] == [t for t, _ in first] and all(c == 0 for _, c in again)
    finally:
        engine.stop()
