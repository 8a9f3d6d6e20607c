"""Round N+1 of a conversation finds round N's prompt and answer under PD, through real servers
(v4-tiny; prefill, decode with --decode-local-prefill and the router, KV over NIXL; a mono engine
beside them), with the official OpenAI client for chat.

Token ids (the next prompt = prompt + answer ids + a new turn) and chat (the client re-sends the
answer's text, rendered with the ids the engine generated): PD's answers equal mono's token for
token, PD's cached_tokens equal mono's and cover the previous prompt + answer but the last
boundary, prefill moves no KV after a conversation's first round, everything is back at the end.
Before this work PD's later rounds recomputed the answer on prefill and shipped the whole
conversation again, and chat re-tokenized the answer (mono too)."""

from __future__ import annotations

import random
import re

import httpx
import openai

from test_pd import PDCluster, complete, loads
from test_v4_pd import tokens, wait_idle

ANSWER = 24  # tokens per answer (past a boundary)
BOUNDARY = 16  # v4-tiny at --page-size 16


def moved(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^dsv4:kv_transfer_bytes_total\{[^}]*\} (\S+)$", text, re.M))


def test_pd_rounds_reuse_prompt_and_answer_like_mono(make_model, tmp_path):
    cluster = PDCluster(make_model("v4-tiny"), tmp_path, decode_args=["--decode-local-prefill", 256])
    try:
        rng = random.Random(5)
        # ---- token ids ----
        history = [rng.randrange(2, 250) for _ in range(100)]
        held = None
        for rnd in range(3):
            before = moved(cluster.p_url)
            pd = complete(cluster.r_url, history, max_tokens=ANSWER)
            mono = complete(cluster.m_url, history, max_tokens=ANSWER)
            assert tokens(pd) == tokens(mono), rnd
            cached = pd["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == mono["usage"]["prompt_tokens_details"]["cached_tokens"], rnd
            if held is not None:
                assert cached == (held - 1) // BOUNDARY * BOUNDARY and cached / held >= 0.85, (rnd, cached, held)
                assert moved(cluster.p_url) == before, "prefill shipped a later round"
            held = len(history) + ANSWER
            history = history + tokens(pd) + [rng.randrange(2, 250) for _ in range(8)]
        # ---- chat, through the official client ----
        clients = {
            side: openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            for side, url in (("pd", cluster.r_url), ("mono", cluster.m_url))
        }
        words = "file line error build test pass module import value return object list".split()
        msgs = [
            {"role": "system", "content": " ".join(rng.choice(words) for _ in range(40))},
            {"role": "user", "content": "what next?"},
        ]
        held = None
        for rnd in range(3):
            before = moved(cluster.p_url)
            out = {
                side: c.chat.completions.create(
                    model="m", messages=msgs, max_tokens=ANSWER, temperature=0, extra_body={"ignore_eos": True}
                )
                for side, c in clients.items()
            }
            pd, mono = out["pd"], out["mono"]
            assert pd.choices[0].message.content == mono.choices[0].message.content, rnd
            cached = pd.usage.prompt_tokens_details.cached_tokens
            assert cached == mono.usage.prompt_tokens_details.cached_tokens, rnd
            if held is not None:
                assert cached / held >= 0.85, (rnd, cached, held)
                assert moved(cluster.p_url) == before, "prefill shipped a later round"
            held = pd.usage.prompt_tokens + pd.usage.completion_tokens
            msgs = msgs + [
                {"role": "assistant", "content": pd.choices[0].message.content},
                {"role": "user", "content": f"and then {rnd}?"},
            ]
        wait_idle(cluster.p_url, cluster.d_url, cluster.m_url)
        pc = loads(cluster.d_url)["prefix_cache"]
        assert pc["enabled"] and pc["snapshots_restored"] >= 4, pc
    finally:
        cluster.stop()
