"""Sessions over HTTP (issue 41, item 2), a real tiny engine and the official openai client: a
conversation named by `prompt_cache_key` (or the `x-session-id` header) keeps its prefix through
a burst of other prompts that pushes an unnamed one out of a small pool; DELETE is per tenant
(the cache salt) and a session another tenant names is unknown to it; bad TTLs and unknown
sessions are clear 4xx; /metrics and /v1/loads show the pins."""

from __future__ import annotations

import httpx
import openai
import pytest

from bench.harness.commands import serving

PAGE = 16


def conv(k: int) -> list[int]:
    return [(13 * k + 7 * i) % 300 + 30 for i in range(4 * PAGE + 1)]  # 4 full pages + 1 token


def cached(client: openai.OpenAI, prompt: list[int], **extra) -> int:
    r = client.completions.create(model="m", prompt=prompt, max_tokens=2, temperature=0, **extra)
    return r.usage.prompt_tokens_details.cached_tokens


def burst(client: openai.OpenAI, k0: int) -> None:
    for k in range(k0, k0 + 6):  # 24 cached pages asked of a 24-page pool holding 8 already
        cached(client, conv(100 + k))


def test_a_named_conversation_keeps_its_prefix_and_a_session_is_its_tenants(tiny_model, tmp_path):
    args = ["--model", tiny_model, "--kv-pages", 24, "--page-size", PAGE, "--served-model-name", "m"]
    with serving(args + ["--session-ttl", 60], tmp_path / "serve.log") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        named = {"extra_body": {"prompt_cache_key": "agent-7", "cache_salt": "tenant-a"}}
        by_header = {"extra_headers": {"x-session-id": "agent-8"}}
        assert cached(client, conv(1), **named) == 0
        assert cached(client, conv(2), **by_header) == 0
        assert cached(client, conv(3)) == 0  # unnamed
        burst(client, 0)
        assert cached(client, conv(3) + [9]) == 0  # the unnamed conversation was evicted
        assert cached(client, conv(1) + [9], **named) == 4 * PAGE
        assert cached(client, conv(2) + [9], **by_header) == 4 * PAGE

        loads = httpx.get(url + "/v1/loads").json()["prefix_cache"]
        assert loads["sessions"]["sessions"] == 2 and loads["sessions"]["pinned_pages"] >= 8
        assert loads["tiers"]["device"]["pages"] >= 8
        metrics = httpx.get(url + "/metrics").text
        assert "dsv4:kv_pages_pinned{" in metrics and "dsv4:prefix_cache_tier_pages{" in metrics

        # DELETE: another tenant's name for it is unknown; the owner ends it; then it is unknown
        sessions = url + "/v1/sessions/agent-7"
        other = httpx.delete(sessions, params={"cache_salt": "tenant-b"})
        assert other.status_code == 404, other.text
        assert other.json()["error"]["code"] == "session_not_found"
        assert httpx.delete(url + "/v1/sessions/agent-7").status_code == 404  # the shared namespace's
        ok = httpx.delete(sessions, params={"cache_salt": "tenant-a"})
        assert ok.status_code == 200 and ok.json()["deleted"] is True
        assert httpx.delete(sessions, params={"cache_salt": "tenant-a"}).status_code == 404
        assert httpx.get(url + "/v1/loads").json()["prefix_cache"]["sessions"]["sessions"] == 1

        # a TTL out of range, or one without a session: 400 naming the header
        for ttl, extra in (("0", named), ("3601", named), ("soon", named), ("5", {})):
            headers = {"x-session-ttl": ttl}
            with pytest.raises(openai.BadRequestError, match="x-session-ttl"):
                cached(client, conv(1), extra_headers=headers, **extra)
        with pytest.raises(openai.BadRequestError, match="prompt_cache_key"):
            cached(client, conv(1), extra_body={"prompt_cache_key": "x" * 300})
