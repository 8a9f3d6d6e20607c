"""A real `dsv4 serve` with the prefix cache (default) and one with --disable-prefix-cache:
the hit/query counters move on /metrics, /v1/loads shows the cached pages (idle ones counted
free), and greedy outputs of both servers match."""

from __future__ import annotations

import json
import re

import httpx

from bench.harness.commands import serving_all
from dsv4_wire import EngineFlags
from dsv4_wire.metrics import metric_name

PROMPT = list(range(5, 70))  # 65 tokens: 4 full pages of 16, the last token recomputed


def counter(text: str, key: str) -> float:
    m = re.search(rf"^{re.escape(metric_name(key, '_total'))}{{[^}}]*}} (\S+)$", text, re.M)
    assert m, f"{key} missing from /metrics"
    return float(m.group(1))


def complete(c: httpx.Client, prompt: list[int]) -> list[int]:
    r = c.post(
        "/v1/completions",
        json={
            "model": "m",
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_metrics_move_and_outputs_match_a_server_without_the_cache(tiny_model, tmp_path):
    common = ["--model", tiny_model, "--kv-pages", 64, "--page-size", 16, "--served-model-name", "m"]
    with serving_all(
        [(common, tmp_path / "on.log"), ([*common, EngineFlags.DISABLE_PREFIX_CACHE], tmp_path / "off.log")]
    ) as (
        on_url,
        off_url,
    ):
        on_server_then_off_server(on_url, off_url)


def on_server_then_off_server(on_url: str, off_url: str) -> None:
    with httpx.Client(base_url=on_url, timeout=120) as c:
        before = c.get("/metrics").text
        assert counter(before, "prefix_cache_hit_tokens") == 0
        first = complete(c, PROMPT)
        second = complete(c, PROMPT + [3, 4, 5])
        text = c.get("/metrics").text
        assert counter(text, "prefix_cache_query_tokens") == 65 + 68
        assert counter(text, "prefix_cache_hit_tokens") == 64
        loads = c.get("/v1/loads").json()
        assert loads["prefix_cache"]["enabled"] is True
        assert loads["kv_pages_cached"] >= 4 and loads["kv_pages_cached_idle"] == loads["kv_pages_cached"]
        assert loads["kv_pages_free"] == loads["kv_pages_total"]  # idle cached pages are not "used"
        # usage says what the cache served (OpenAI's prompt_tokens_details.cached_tokens), streamed too
        r = c.post("/v1/completions", json={"model": "m", "prompt": PROMPT + [3, 4, 5], "max_tokens": 2})
        assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}, r.json()["usage"]
        r = c.post(
            "/v1/completions",
            json={
                "model": "m",
                "prompt": [9] * 40,
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        last = [ln for ln in r.text.splitlines() if ln.startswith("data: {")][-1]
        assert json.loads(last[6:])["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    with httpx.Client(base_url=off_url, timeout=120) as c:
        assert complete(c, PROMPT) == first
        assert complete(c, PROMPT + [3, 4, 5]) == second
        assert counter(c.get("/metrics").text, "prefix_cache_query_tokens") == 0
        loads = c.get("/v1/loads").json()
        assert loads["prefix_cache"] == {"enabled": False, "why": "turned off (--disable-prefix-cache)"}
