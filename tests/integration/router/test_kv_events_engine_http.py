"""KV cache events from real engines (issue 41, item 4): two tiny mono engines serve
GET /v1/kv_events (behind the PD secret), a real router follows both, and a prompt goes to the
engine whose stream says it holds the prompt's pages. Each engine is seeded directly with its
own prompts (the router sees none of them), so only the events can tell the router where they
are: without them its affinity would pick by a hash of the prompt (3 prompts each: 1/64 chance
of passing by luck)."""

from __future__ import annotations

import json
import time

import httpx
import openai

from bench.harness.commands import Proc, free_port, stop_all
from dsv4_wire import kv_events as wire

SECRET = "s3cret-for-events"
PAGE = 16


def prompt(k: int) -> list[int]:
    return [(37 * k + 11 * i) % 400 + 20 for i in range(4 * PAGE + 3)]  # 4 full pages


def first_messages(url: str, n: int, timeout: float = 20) -> list[dict]:
    out = []
    with httpx.stream(
        "GET", url + "/v1/kv_events", headers={"Authorization": f"Bearer {SECRET}"}, timeout=timeout
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith(wire.CONTENT_TYPE)
        for line in r.iter_lines():
            if line.strip():
                out.append(wire.decode(line))
            if len(out) == n:
                return out
    return out


def test_a_real_router_places_prompts_where_real_engines_say_their_pages_are(tiny_model, tmp_path):
    common = ["--model", tiny_model, "--kv-pages", 96, "--page-size", PAGE, "--served-model-name", "m"]
    ports = [free_port(), free_port()]
    engines = [
        Proc(["serve", *common, "--port", p, "--pd-secret", SECRET], tmp_path / f"e{i}.log")
        for i, p in enumerate(ports)
    ]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    router = None
    try:
        for e, u in zip(engines, urls):
            e.wait_ready(u)
        # the endpoint is an internal one: no secret, no stream
        assert httpx.get(urls[0] + "/v1/kv_events").status_code == 401
        # a new subscriber's first message is a snapshot of an empty cache (batch 1: all cleared)
        (snap,) = first_messages(urls[0], 1)
        assert snap["type"] == "snapshot" and snap["role"] == "mono" and snap["page_size"] == PAGE
        assert snap["tiers"]["device"] == [] and snap["seq"] == 1
        view = wire.EngineView()
        assert view.apply(snap)

        # seed each engine directly with its own prompts
        for i, u in enumerate(urls):
            client = openai.OpenAI(base_url=u + "/v1", api_key=SECRET, max_retries=0)
            for k in range(3):
                client.completions.create(model="m", prompt=prompt(10 * i + k), max_tokens=2, temperature=0)
        # a snapshot now holds the seeded prompts' pages, hashed as the contract says
        (snap,) = first_messages(urls[0], 1)
        held = set(snap["tiers"]["device"])
        for k in range(3):
            assert {h.hex() for h in wire.page_hashes(prompt(k), PAGE)} <= held
        assert not {h.hex() for h in wire.page_hashes(prompt(10), PAGE)} & held

        r_port = free_port()
        args = ["router", "--port", r_port, "--health-interval", "0.5", "--pd-secret", SECRET]
        for u in urls:
            args += ["--mono", u]
        router = Proc(args, tmp_path / "router.log")
        rurl = f"http://127.0.0.1:{r_port}"
        router.wait_ready(rurl)
        deadline = time.monotonic() + 30
        while True:  # the router follows both engines' streams
            ws = httpx.get(f"{rurl}/admin/workers").json()["workers"]
            if all(w["cache"] and w["cache"].get("fresh") and w["cache"]["pages"]["device"] >= 12 for w in ws):
                break
            assert time.monotonic() < deadline, json.dumps(ws)
            time.sleep(0.1)

        client = openai.OpenAI(base_url=rurl + "/v1", api_key=SECRET, max_retries=0)
        for i in range(2):
            for k in range(3):
                r = client.completions.create(
                    model="m", prompt=prompt(10 * i + k) + [5, 6], max_tokens=1, temperature=0
                )
                # served where the pages were: every full page of the seeded prompt reused
                assert r.usage.prompt_tokens_details.cached_tokens == 4 * PAGE, (i, k, r.usage)
    finally:
        stop_all([router, *engines])
