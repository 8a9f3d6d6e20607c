"""DeepSeek-V4 prefill/decode edges over real NIXL between real processes, behind the real router,
with a decode too small for the load: 2 slot rows and 24 pages of 4 tokens.

Seeded sampling through PD gives mono's tokens (decode used to restart the request's random
stream that prefill had already drawn from); a 1-token prompt and max_tokens=1 hand off; more
concurrent requests than decode has rows, with clients giving up mid-prefill, mid-transfer and
mid-decode, leave every page and slot row back on both engines and the survivors exact."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from test_pd import PDCluster, complete, loads
from test_v4_pd import tokens, wait_idle

# Decode's waits for a row are bounded by the bootstrap deadline: generous, for two busy cores.
DEADLINES = ["--bootstrap-timeout", 30]


@pytest.fixture(scope="module")
def cluster(make_model, tmp_path_factory):
    c = PDCluster(
        make_model("v4-tiny"),
        tmp_path_factory.mktemp("v4edges"),
        prefill_args=[*DEADLINES, "--page-size", 4],
        decode_args=[*DEADLINES, "--max-num-seqs", 2, "--kv-pages", 24, "--page-size", 4],
    )
    yield c
    c.stop()


def test_decode_pool_is_the_small_one(cluster):
    ld = loads(cluster.d_url)
    assert (ld["kv_slots_total"], ld["kv_pages_total"], ld["kv_page_size"]) == (2, 24, 4)


@pytest.mark.parametrize(
    "params",
    [dict(temperature=0.9, seed=7), dict(temperature=1.0, seed=11, top_p=0.8), dict(temperature=0.7, seed=3, top_k=5)],
    ids=["temperature", "top_p", "top_k"],
)
def test_seeded_sampling_through_pd_equals_mono(cluster, params):
    prompt = list(range(3, 20))
    pd = complete(cluster.r_url, prompt, max_tokens=12, **params)
    assert tokens(pd) == tokens(complete(cluster.m_url, prompt, max_tokens=12, **params))
    assert len(set(tokens(pd))) > 3  # really sampled


def test_one_token_prompt_and_one_token_answer(cluster):
    for prompt, n in (([5], 1), ([5], 4), (list(range(2, 30)), 1)):
        pd = complete(cluster.r_url, prompt, max_tokens=n, logprobs=2)
        mono = complete(cluster.m_url, prompt, max_tokens=n, logprobs=2)
        assert tokens(pd) == tokens(mono) and len(tokens(pd)) == n
        assert pd["choices"][0]["logprobs"] == mono["choices"][0]["logprobs"]
    wait_idle(cluster.p_url, cluster.d_url, timeout=30.0)


def test_more_requests_than_decode_rows_with_clients_giving_up(cluster):
    """16 requests at once (2 rows on decode; requests grow to 64 tokens, so decode also
    preempts); a third of the clients give up at random moments. Every page and row comes back
    on both sides; every request that was let finish equals mono."""
    rng = random.Random(4)
    reqs = [
        ([rng.randrange(2, 500) for _ in range(rng.randint(1, 40))], rng.choice([None, None, 0.2, 0.6, 1.5]))
        for _ in range(16)
    ]

    async def one(client, prompt, give_up):
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        try:
            r = await asyncio.wait_for(client.post("/v1/completions", json=body), give_up)
        except asyncio.TimeoutError:
            return None
        assert r.status_code == 200, r.text
        return tokens(r.json())

    async def all_of_them():
        async with httpx.AsyncClient(base_url=cluster.r_url, timeout=120) as client:
            return await asyncio.gather(*(one(client, p, g) for p, g in reqs))

    got = asyncio.run(all_of_them())
    wait_idle(cluster.p_url, cluster.d_url, timeout=30.0)
    assert all(toks is not None for (_, give_up), toks in zip(reqs, got) if give_up is None)
    finished = [(p, toks) for (p, _), toks in zip(reqs, got) if toks is not None]
    for prompt, toks in finished:
        assert toks == tokens(complete(cluster.m_url, prompt, max_tokens=24)), len(prompt)
