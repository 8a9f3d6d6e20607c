"""cache_salt over HTTP (issue 27, item 2), with the official openai client: the same prompt
under another salt, or none, reports no cached tokens, so `cached_tokens` tells no caller
whether someone else's prompt is cached; the same salt is served from the cache."""

from __future__ import annotations

import openai
import pytest

from bench.harness.commands import serving

PROMPT = list(range(5, 70))  # 65 tokens: 4 full pages of 16


def cached(client: openai.OpenAI, salt: str | None, chat: bool = False) -> int:
    extra = {"cache_salt": salt} if salt is not None else {}
    if chat:
        r = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "tell me " * 40}],
            max_tokens=2,
            temperature=0,
            extra_body=extra,
        )
    else:
        r = client.completions.create(model="m", prompt=PROMPT, max_tokens=2, temperature=0, extra_body=extra)
    return r.usage.prompt_tokens_details.cached_tokens


def test_a_salt_sees_only_its_own_cache(tiny_model, tmp_path):
    args = ["--model", tiny_model, "--kv-pages", 64, "--page-size", 16, "--served-model-name", "m"]
    with serving(args, tmp_path / "serve.log") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert cached(client, "tenant-a") == 0
        assert cached(client, "tenant-b") == 0  # before the fix: 64, tenant-a's prefix
        assert cached(client, None) == 0
        assert cached(client, "tenant-a") == 64
        assert cached(client, "tenant-b") == 64  # its own copy now
        assert cached(client, "tenant-a", chat=True) == 0
        assert cached(client, "tenant-b", chat=True) == 0
        assert cached(client, "tenant-a", chat=True) > 0
        with pytest.raises(openai.BadRequestError, match="cache_salt"):
            cached(client, "")
