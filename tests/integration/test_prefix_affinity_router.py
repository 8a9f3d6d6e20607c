"""Prefix affinity at its edges, end to end: a real router in front of two real engines.

Plain-text and token-id conversations whose first round is shorter than the router's key stay
on one engine round after round (and hit its cache); taking that engine out over /admin/workers,
putting it back, and killing it move the conversation without a single failed request."""

from __future__ import annotations

import random
import re

import httpx

from bench.harness.commands import Proc, free_port, stop_all
from dsv4_wire.metrics import metric_name


def sent_to(router: str, urls: list[str]) -> list[float]:
    """Requests the router sent to each engine so far (its own counter: exact, no lag)."""
    text = httpx.get(f"{router}/metrics", timeout=10).text
    out = []
    for u in urls:
        m = re.search(rf'^dsv4_router:worker_requests_total{{[^}}]*worker="{re.escape(u)}"[^}}]*}} (\S+)$', text, re.M)
        out.append(float(m.group(1)) if m else 0.0)
    return out


def hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(metric_name('prefix_cache_hit_tokens', '_total'))}{{[^}}]*}} (\S+)$", text, re.M)
    assert m
    return float(m.group(1))


def test_short_plain_conversations_keep_their_engine_and_survive_membership_changes(tiny_model, tmp_path):
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    engines = [
        Proc(
            ["serve", "--model", tiny_model, "--port", p, "--served-model-name", "m", "--kv-pages", 128],
            tmp_path / f"engine{i}.log",
        )
        for i, p in enumerate(ports)
    ]
    r_port = free_port()
    router_url = f"http://127.0.0.1:{r_port}"
    router = Proc(
        ["router", *[x for u in urls for x in ("--mono", u)], "--port", r_port, "--health-interval", "0.5"],
        tmp_path / "router.log",
    )
    rng = random.Random(4)
    try:
        for e, u in zip(engines, urls):
            e.wait_ready(u)
        router.wait_ready(router_url)
        router.wait_workers_healthy(router_url, 2)
        with httpx.Client(base_url=router_url, timeout=120) as c:

            def round_(prompt) -> int:
                """Send one round; the index of the engine it went to."""
                before = sent_to(router_url, urls)
                r = c.post(
                    "/v1/completions",
                    json={"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0, "return_token_ids": True},
                )
                assert r.status_code == 200, r.text
                moved = [i for i, (a, b) in enumerate(zip(before, sent_to(router_url, urls))) if b > a]
                assert len(moved) == 1, moved
                return moved[0]

            # Four conversations of each kind, four rounds each, the first round under the key.
            convos = [f"Trip {i}: walk the ridge, then " for i in range(4)] + [
                [rng.randrange(3, 400) for _ in range(12)] for _ in range(4)
            ]
            where = {}
            hits_before = [hits(u) for u in urls]
            for rnd in range(4):
                for i, convo in enumerate(convos):
                    where.setdefault(i, set()).add(round_(convo))
                    convos[i] = convo + (
                        " and rest by the river" * 2
                        if isinstance(convo, str)
                        else [rng.randrange(3, 400) for _ in range(40)]
                    )
            assert all(len(w) == 1 for w in where.values()), where  # every conversation stayed put
            assert sum(hits(u) for u in urls) - sum(hits_before) > 0

            # Out of rotation over /admin/workers: the conversation moves, nothing fails; back in:
            # it returns to the engine it prefers (rendezvous hashing).
            i = 0
            home = next(iter(where[i]))
            r = httpx.request("DELETE", f"{router_url}/admin/workers", json={"url": urls[home]}, timeout=10)
            assert r.status_code == 200, r.text
            assert round_(convos[i]) == 1 - home
            r = httpx.post(f"{router_url}/admin/workers", json={"url": urls[home], "role": "mono"}, timeout=30)
            assert r.status_code == 200 and r.json()["healthy"], r.text
            assert round_(convos[i] + " again") == home
            # The engine dies: the router retries on the other one; the client sees no error.
            engines[home].stop()
            for convo in convos:
                r = c.post("/v1/completions", json={"model": "m", "prompt": convo, "max_tokens": 2, "temperature": 0})
                assert r.status_code == 200, r.text
    finally:
        stop_all([router, *engines])
