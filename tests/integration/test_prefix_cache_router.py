"""Prefix affinity end to end: a real router in front of two real engines sends every round of a
chat conversation to the same engine, whose prefix cache then serves the earlier rounds."""

from __future__ import annotations

import re

import httpx

from bench.harness.commands import Proc, free_port, stop_all
from dsv4_wire.metrics import metric_name


def counter(url: str, key: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(metric_name(key, '_total'))}{{[^}}]*}} (\S+)$", text, re.M)
    assert m, f"{key} missing"
    return float(m.group(1))


def test_rounds_of_a_conversation_stay_on_one_engine_and_hit_its_cache(tiny_model, tmp_path):
    ports = [free_port(), free_port()]
    engines = [
        Proc(
            ["serve", "--model", tiny_model, "--port", p, "--served-model-name", "m", "--kv-pages", 128],
            tmp_path / f"engine{i}.log",
        )
        for i, p in enumerate(ports)
    ]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    r_port = free_port()
    router = Proc(
        ["router", *[x for u in urls for x in ("--mono", u)], "--port", r_port, "--health-interval", "0.5"],
        tmp_path / "router.log",
    )
    try:
        for e, u in zip(engines, urls):
            e.wait_ready(u)
        router.wait_ready(f"http://127.0.0.1:{r_port}")
        router.wait_workers_healthy(f"http://127.0.0.1:{r_port}", len(urls))  # else round 1 may see one engine
        messages = [
            {"role": "system", "content": "You answer in lists. " * 6},
            {"role": "user", "content": "Plan a four-day walk across the hills, with stops. " * 3},
        ]
        with httpx.Client(base_url=f"http://127.0.0.1:{r_port}", timeout=120) as c:
            for rnd in range(4):
                r = c.post(
                    "/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 8, "temperature": 0}
                )
                assert r.status_code == 200, r.text
                messages = messages + [
                    {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                    {"role": "user", "content": f"And on day {rnd + 2}?"},
                ]
        queried = [counter(u, "prefix_cache_query_tokens") for u in urls]
        hits = [counter(u, "prefix_cache_hit_tokens") for u in urls]
        assert sorted(q > 0 for q in queried) == [False, True], queried  # one engine took every round
        assert max(hits) > 0.5 * max(queried), (hits, queried)
    finally:
        stop_all([router, *engines])
