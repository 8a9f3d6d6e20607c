"""Sessions through a real router (issue 41, item 2): the `x-session-id` header reaches the engine
that prefills as the session (PD: prefill and decode get the same body), keyed by the tenant the
router derives from the API key; DELETE through the router ends it for its tenant only (another
key's DELETE of the same name is a 404, and leaves it pinned). Prefill and decode both serve
their KV events."""

from __future__ import annotations

import httpx
import openai

from bench.harness.commands import Proc, free_port, stop_all
from dsv4_wire import kv_events as wire

PAGE = 16
PROMPT = [(7 * i) % 300 + 30 for i in range(4 * PAGE + 1)]


def test_a_session_named_by_header_is_its_tenants_through_the_router(tiny_model, tmp_path):
    common = ["--model", tiny_model, "--kv-pages", 64, "--page-size", PAGE, "--served-model-name", "m"]
    p_port, d_port, r_port = free_port(), free_port(), free_port()
    prefill = Proc(
        ["serve", *common, "--role", "prefill", "--port", p_port, "--bootstrap-port", free_port()], tmp_path / "p.log"
    )
    decode = Proc(["serve", *common, "--role", "decode", "--port", d_port], tmp_path / "d.log")
    purl, durl, rurl = (f"http://127.0.0.1:{p}" for p in (p_port, d_port, r_port))
    router = None
    try:
        prefill.wait_ready(purl)
        decode.wait_ready(durl)
        router = Proc(
            [
                "router",
                "--port",
                r_port,
                "--prefill",
                purl,
                "--decode",
                durl,
                "--api-key",
                "key-a",
                "--api-key",
                "key-b",
                "--cache-salt-from-api-key",
            ],
            tmp_path / "router.log",
        )
        router.wait_ready(rurl)
        a = openai.OpenAI(base_url=rurl + "/v1", api_key="key-a", max_retries=0)
        r = a.completions.create(
            model="m", prompt=PROMPT, max_tokens=3, temperature=0, extra_headers={"x-session-id": "agent-1"}
        )
        assert r.choices[0].finish_reason == "length"
        sessions = httpx.get(purl + "/v1/loads").json()["prefix_cache"]["sessions"]
        assert sessions["sessions"] == 1 and sessions["pinned_pages"] == 4
        # every role publishes KV events: prefill its cache, decode the conversation it holds for
        # the next round (--decode-local-prefill, on by default): the landed prompt's 4 pages
        for url, role, held in ((purl, "prefill", 4), (durl, "decode", 4)):
            with httpx.stream("GET", url + "/v1/kv_events", timeout=20) as r:
                snap = wire.decode(next(line for line in r.iter_lines() if line.strip()))
            assert snap["type"] == "snapshot" and snap["role"] == role and len(snap["tiers"]["device"]) == held

        def delete(key: str) -> httpx.Response:
            return httpx.delete(rurl + "/v1/sessions/agent-1", headers={"Authorization": f"Bearer {key}"})

        other = delete("key-b")
        assert other.status_code == 404 and other.json()["error"]["code"] == "session_not_found"
        assert httpx.get(purl + "/v1/loads").json()["prefix_cache"]["sessions"]["pinned_pages"] == 4
        assert httpx.delete(rurl + "/v1/sessions/agent-1").status_code == 401  # no key, no tenant
        ok = delete("key-a")
        assert ok.status_code == 200 and ok.json()["deleted"] is True
        assert httpx.get(purl + "/v1/loads").json()["prefix_cache"]["sessions"]["sessions"] == 0
        assert delete("key-a").status_code == 404
    finally:
        stop_all([router, prefill, decode])
