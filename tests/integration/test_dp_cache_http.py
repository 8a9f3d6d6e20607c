"""`dsv4 serve --tp-size 2 --dp-size 2` as a real process (rank 1 its child, gloo on 127.0.0.1),
the official `openai` client: four conversations at once over one system prompt run on both ranks;
each next round lands on its conversation's rank (its cached tokens reach past the system prompt
into its own first round, which only that rank holds); `/v1/loads` and `/metrics` show each rank
(running requests, pages, cached pages, hits)."""

from __future__ import annotations

import re
import threading

import httpx
import openai
import pytest

from bench.harness.commands import serving

pytestmark = pytest.mark.slow

SYSTEM = "You are a terse assistant. Answer in one line, no preamble, no apologies. " * 2
ARGS = ["--kv-pages", 64, "--page-size", 8, "--served-model-name", "tiny", "--device", "cpu"]


def series(text: str, name: str) -> dict[int, float]:
    """rank -> value of a dp_rank-labelled series in a /metrics text."""
    out = {}
    for m in re.finditer(rf'^dsv4:{name}{{dp_rank="(\d+)",[^}}]*}} (\S+)$', text, re.M):
        out[int(m.group(1))] = float(m.group(2))
    return out


def test_dp2_over_http_keeps_each_conversation_on_its_rank_and_shows_each_rank(tiny_model, tmp_path):
    with serving(["--model", tiny_model, *ARGS, "--tp-size", 2, "--dp-size", 2], tmp_path / "dp2.log") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120)
        prompts = {k: SYSTEM + f"User {k}: tell me about {k}." for k in ("rivers", "mountains", "deserts", "forests")}
        answers: dict[str, str] = {}
        prompt_tokens: dict[str, int] = {}
        seen_running: list[list[int]] = []

        def first_round(k: str) -> None:
            r = client.completions.create(model="tiny", prompt=prompts[k], max_tokens=48, temperature=0)
            answers[k], prompt_tokens[k] = r.choices[0].text, r.usage.prompt_tokens

        threads = [threading.Thread(target=first_round, args=(k,)) for k in prompts]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            ranks = httpx.get(f"{url}/v1/loads").json()["dp_ranks"]
            seen_running.append([r["running"] for r in ranks])
            threads[0].join(0.05)
        for t in threads:
            t.join()
        assert all(any(s[r] for s in seen_running) for r in (0, 1)), seen_running  # both ranks served
        system_tokens = client.completions.create(model="tiny", prompt=SYSTEM, max_tokens=1).usage.prompt_tokens
        before = {r["rank"]: r["prefix_cache_hit_tokens"] for r in httpx.get(f"{url}/v1/loads").json()["dp_ranks"]}
        for k in reversed(list(prompts)):  # one at a time: placed by prefix, not by load
            r = client.completions.create(
                model="tiny", prompt=prompts[k] + answers[k] + " And more?", max_tokens=4, temperature=0
            )
            cached = r.usage.prompt_tokens_details.cached_tokens
            assert cached >= prompt_tokens[k] - 8 > system_tokens, (k, cached, prompt_tokens[k], system_tokens)
        loads = httpx.get(f"{url}/v1/loads").json()
        after = {r["rank"]: r["prefix_cache_hit_tokens"] for r in loads["dp_ranks"]}
        assert all(after[r] > before[r] for r in (0, 1)), (before, after)  # second rounds hit on both ranks
        assert loads["prefix_cache"]["enabled"] and loads["prefix_cache"]["hit_tokens"] == sum(after.values())
        assert all(r["kv_pages_cached"] > 0 and r["kv_pages_free"] == 64 for r in loads["dp_ranks"]), loads
        text = httpx.get(f"{url}/metrics").text
        assert series(text, "dp_rank_prefix_cache_hit_tokens_total") == {r: float(v) for r, v in after.items()}
        assert series(text, "dp_rank_running_reqs") == {0: 0.0, 1: 0.0}
        assert series(text, "dp_rank_kv_pages_free") == {0: 64.0, 1: 64.0}
        cached = series(text, "dp_rank_prefix_cache_pages")
        assert cached == {r["rank"]: float(r["kv_pages_cached"]) for r in loads["dp_ranks"]}
