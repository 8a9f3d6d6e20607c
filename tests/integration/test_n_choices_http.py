"""n > 1 and best_of over real HTTP with the official `openai` client: a monolithic engine, then
a router over a real prefill/decode pair (NIXL). Each choice j samples what a lone request with
seed + j samples; streamed choices carry their `index` (prompt i's choice j is i * n + j);
usage counts the prompt once; best_of returns the candidates with the highest cumulative
logprob; PD gives what mono gives; every page is back afterwards."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from bench.harness.commands import Proc, free_port, stop_all

PROMPT = "the quick brown fox jumps over the lazy dog and then it runs far away into the woods"
CHAT = [{"role": "user", "content": "tell me a story about a fox and a dog in the woods"}]
COMMON = ["--kv-pages", 128, "--page-size", 16, "--served-model-name", "tiny"]


@pytest.fixture(scope="module")
def urls(tiny_model, tmp_path_factory):
    """{"mono": url, "pd": router url, "prefill": url, "decode": url}."""
    tmp = tmp_path_factory.mktemp("n-choices")
    m_port, p_port, b_port, d_port, r_port = (free_port() for _ in range(5))
    base = ["serve", "--model", tiny_model, *COMMON]
    procs = [
        Proc([*base, "--role", "mono", "--port", m_port], tmp / "mono.log"),
        Proc([*base, "--role", "prefill", "--port", p_port, "--bootstrap-port", b_port], tmp / "prefill.log"),
        Proc([*base, "--role", "decode", "--port", d_port], tmp / "decode.log"),
    ]
    u = {
        role: f"http://127.0.0.1:{port}"
        for role, port in (("mono", m_port), ("prefill", p_port), ("decode", d_port), ("pd", r_port))
    }
    procs.append(
        Proc(
            [
                "router",
                "--prefill",
                u["prefill"],
                "--decode",
                u["decode"],
                "--port",
                r_port,
                "--health-interval",
                "0.5",
            ],
            tmp / "router.log",
        )
    )
    try:
        for url, proc in zip((u["mono"], u["prefill"], u["decode"], u["pd"]), procs):
            proc.wait_ready(url)
        yield u
    finally:
        stop_all(procs)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def wait_pages_back(*urls: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    for url in urls:
        while True:
            ld = httpx.get(f"{url}/v1/loads", timeout=5).json()
            if ld["kv_pages_free"] == ld["kv_pages_total"] and sum(ld["queues"].values()) == 0:
                break
            assert time.monotonic() < deadline, f"{url} still holds pages: {ld}"
            time.sleep(0.05)


SAMPLED = dict(max_tokens=8, temperature=1.0, seed=1234, extra_body={"ignore_eos": True, "return_token_ids": True})


def completion_choices(
    url: str, prompt=PROMPT, stream: bool = False, model: str = "tiny", **kw
) -> tuple[list[dict], dict]:
    """(choices as {index, text, token_ids, finish_reason} in index order, usage)."""
    args = {**SAMPLED, **kw}
    c = client(url)
    if not stream:
        r = c.completions.create(model=model, prompt=prompt, **args)
        return [
            {
                "index": ch.index,
                "text": ch.text,
                "token_ids": ch.model_extra["token_ids"],
                "finish_reason": ch.finish_reason,
            }
            for ch in r.choices
        ], r.usage.model_dump()
    got: dict[int, dict] = {}
    usage = None
    for ev in c.completions.create(
        model=model, prompt=prompt, stream=True, stream_options={"include_usage": True}, **args
    ):
        for ch in ev.choices:
            g = got.setdefault(ch.index, {"index": ch.index, "text": "", "token_ids": [], "finish_reason": None})
            g["text"] += ch.text
            g["token_ids"] += ch.model_extra.get("token_ids") or []
            g["finish_reason"] = ch.finish_reason or g["finish_reason"]
        if ev.usage is not None:
            usage = ev.usage.model_dump()
    return [got[i] for i in sorted(got)], usage


def chat_choices(url: str, stream: bool = False, model: str = "tiny", **kw) -> tuple[list[dict], dict]:
    args = {**SAMPLED, **kw}
    c = client(url)
    if not stream:
        r = c.chat.completions.create(model=model, messages=CHAT, **args)
        return [
            {
                "index": ch.index,
                "content": ch.message.content,
                "role": ch.message.role,
                "token_ids": ch.model_extra["token_ids"],
                "finish_reason": ch.finish_reason,
            }
            for ch in r.choices
        ], r.usage.model_dump()
    got: dict[int, dict] = {}
    usage = None
    for ev in c.chat.completions.create(
        model=model, messages=CHAT, stream=True, stream_options={"include_usage": True}, **args
    ):
        for ch in ev.choices:
            g = got.setdefault(
                ch.index, {"index": ch.index, "content": "", "role": None, "token_ids": [], "finish_reason": None}
            )
            g["role"] = ch.delta.role or g["role"]
            g["content"] += ch.delta.content or ""
            g["token_ids"] += ch.model_extra.get("token_ids") or []
            g["finish_reason"] = ch.finish_reason or g["finish_reason"]
        if ev.usage is not None:
            usage = ev.usage.model_dump()
    return [got[i] for i in sorted(got)], usage


def test_each_choice_samples_what_a_lone_request_with_seed_plus_j_samples(urls):
    mono = urls["mono"]
    choices, usage = completion_choices(mono, n=3)
    assert [c["index"] for c in choices] == [0, 1, 2]
    lone = [completion_choices(mono, seed=1234 + j)[0][0] for j in range(3)]
    assert [c["token_ids"] for c in choices] == [c["token_ids"] for c in lone]
    assert [c["text"] for c in choices] == [c["text"] for c in lone]
    assert len({tuple(c["token_ids"]) for c in choices}) > 1
    _, lone_usage = completion_choices(mono, seed=1234)
    assert usage["prompt_tokens"] == lone_usage["prompt_tokens"]  # the prompt counts once
    assert usage["completion_tokens"] == 3 * 8 and usage["total_tokens"] == usage["prompt_tokens"] + 24
    assert completion_choices(mono, n=3)[0] == choices  # reproducible, choice by choice
    wait_pages_back(mono)


def test_the_other_choices_reuse_the_prompt_pages(urls):
    mono = urls["mono"]
    before = httpx.get(f"{mono}/v1/loads").json()["prefix_cache"]["hit_tokens"]
    prompt = list(range(100, 150))  # 50 tokens: 3 full pages of 16 before the last token
    _, usage = completion_choices(mono, prompt=prompt, n=4)
    after = httpx.get(f"{mono}/v1/loads").json()["prefix_cache"]["hit_tokens"]
    assert after - before == 3 * 48
    assert usage["prompt_tokens"] == 50 and usage["prompt_tokens_details"]["cached_tokens"] == 0  # the first choice's
    wait_pages_back(mono)


def counts(usage: dict) -> tuple:
    """Usage without cached_tokens (a repeated prompt is cached the second time)."""
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


def test_streamed_choices_equal_the_whole_answer(urls):
    mono = urls["mono"]
    whole, usage = completion_choices(mono, n=3)
    streamed, s_usage = completion_choices(mono, n=3, stream=True)
    assert streamed == whole and counts(s_usage) == counts(usage)
    whole, usage = chat_choices(mono, n=3)
    streamed, s_usage = chat_choices(mono, n=3, stream=True)
    assert [c["role"] for c in streamed] == ["assistant"] * 3  # a role chunk per choice
    assert streamed == whole and counts(s_usage) == counts(usage)
    assert len({tuple(c["token_ids"]) for c in whole}) > 1
    wait_pages_back(mono)


def test_several_prompts_number_their_choices_prompt_major(urls):
    mono = urls["mono"]
    prompts = [PROMPT, "a completely different prompt"]
    for stream in (False, True):
        choices, usage = completion_choices(mono, prompt=prompts, n=2, stream=stream)
        assert [c["index"] for c in choices] == [0, 1, 2, 3]
        for i, p in enumerate(prompts):
            for j in range(2):
                lone, lone_usage = completion_choices(mono, prompt=p, seed=1234 + j)
                assert choices[i * 2 + j]["token_ids"] == lone[0]["token_ids"], (stream, i, j)
        singles = sum(completion_choices(mono, prompt=p)[1]["prompt_tokens"] for p in prompts)
        assert usage["prompt_tokens"] == singles and usage["completion_tokens"] == 4 * 8
    wait_pages_back(mono)


def test_best_of_returns_the_candidates_with_the_highest_cumulative_logprob(urls):
    mono = urls["mono"]
    choices, usage = completion_choices(mono, n=2, best_of=4, logprobs=0)
    cands = []
    for j in range(4):
        r = client(mono).completions.create(model="tiny", prompt=PROMPT, logprobs=0, **{**SAMPLED, "seed": 1234 + j})
        cands.append((sum(r.choices[0].logprobs.token_logprobs), r.choices[0].model_extra["token_ids"]))
    best = sorted(cands, key=lambda c: -c[0])[:2]
    assert [c["token_ids"] for c in choices] == [b[1] for b in best]
    assert [c["index"] for c in choices] == [0, 1]
    assert usage["completion_tokens"] == 4 * 8  # every candidate generated
    # without logprobs asked, none are shown (the ranking's are internal)
    r = client(mono).completions.create(model="tiny", prompt=PROMPT, n=2, best_of=4, **SAMPLED)
    assert [c.model_extra["token_ids"] for c in r.choices] == [b[1] for b in best]
    assert all(c.logprobs is None for c in r.choices)
    r = client(mono).chat.completions.create(model="tiny", messages=CHAT, n=1, extra_body={"best_of": 3}, max_tokens=4)
    assert len(r.choices) == 1 and r.choices[0].logprobs is None
    wait_pages_back(mono)


def test_a_client_leaving_mid_stream_frees_every_choice(urls):
    def aborted(url: str) -> float:
        return httpx.get(f"{url}/v1/loads", timeout=5).json()["counters"].get("num_aborted_reqs", 0)

    for url, holders in ((urls["mono"], (urls["mono"],)), (urls["pd"], (urls["prefill"], urls["decode"]))):
        before = aborted(holders[-1])
        body = {"prompt": PROMPT, "n": 4, "max_tokens": 200, "ignore_eos": True, "stream": True, "seed": 5}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            seen = set()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    seen.update(c["index"] for c in json.loads(line[6:])["choices"])
                if len(seen) == 4:
                    break  # every choice is running: leave
        wait_pages_back(*holders)
        assert aborted(holders[-1]) - before == 4  # each choice was aborted, not run to its end


def test_greedy_choices_are_identical(urls):
    choices, _ = completion_choices(urls["mono"], n=3, temperature=0)
    assert len(choices) == 3 and len({tuple(c["token_ids"]) for c in choices}) == 1


@pytest.mark.parametrize(
    "body,param",
    [
        ({"n": 17}, "n"),
        ({"n": 0}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": 17}, "best_of"),
        ({"n": 2, "best_of": 3, "stream": True}, "best_of"),
    ],
)
def test_choices_beyond_the_limits_are_a_400_naming_the_field(urls, body, param):
    for path, extra in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": CHAT})):
        r = httpx.post(f"{urls['mono']}{path}", json={**extra, "max_tokens": 4, **body}, timeout=30)
        assert r.status_code == 400, (path, body, r.text)
        assert r.json()["error"]["param"] == param, r.json()


def test_pd_gives_what_mono_gives_for_n_choices(urls):
    mono, pd = urls["mono"], urls["pd"]
    for stream in (False, True):
        m, m_usage = completion_choices(mono, n=3, stream=stream)
        p, p_usage = completion_choices(pd, n=3, stream=stream)
        assert p == m and p_usage["completion_tokens"] == m_usage["completion_tokens"] == 24, stream
        assert p_usage["prompt_tokens"] == m_usage["prompt_tokens"]
        m, _ = chat_choices(mono, n=3, stream=stream)
        p, _ = chat_choices(pd, n=3, stream=stream)
        assert p == m, stream
    m, _ = completion_choices(mono, prompt=[PROMPT, "another prompt"], n=2, stream=True)
    p, _ = completion_choices(pd, prompt=[PROMPT, "another prompt"], n=2, stream=True)
    assert p == m and len(p) == 4
    m, _ = completion_choices(mono, n=2, best_of=3)
    p, _ = completion_choices(pd, n=2, best_of=3)
    assert p == m
    wait_pages_back(urls["prefill"], urls["decode"], mono)
    assert httpx.get(f"{urls['prefill']}/v1/loads").json()["counters"]["kv_transfers_completed"] >= 3 * 4 + 4 + 3


@pytest.fixture(scope="module")
def v4_cluster(make_model, tmp_path_factory):
    from test_pd import PDCluster

    c = PDCluster(make_model("v4-tiny"), tmp_path_factory.mktemp("n-choices-v4"))
    yield c
    c.stop()


@pytest.mark.slow
def test_v4_pd_gives_what_v4_mono_gives_for_n_choices(v4_cluster):
    """V4 (no prefix cache: each choice prefills; a slot row per choice moves to decode)."""
    c = v4_cluster
    prompt = list(range(20, 65))  # past v4-tiny's window and compression boundaries
    for stream in (False, True):
        m, m_usage = completion_choices(c.m_url, prompt=prompt, n=3, stream=stream, model="m")
        p, p_usage = completion_choices(c.r_url, prompt=prompt, n=3, stream=stream, model="m")
        assert p == m and len(p) == 3 and counts(p_usage) == counts(m_usage), stream
        assert len({tuple(x["token_ids"]) for x in p}) > 1
    lone = [completion_choices(c.m_url, prompt=prompt, seed=1234 + j, model="m")[0][0] for j in range(3)]
    assert [x["token_ids"] for x in lone] == [x["token_ids"] for x in p]
    for url in (c.p_url, c.d_url, c.m_url):
        deadline = time.monotonic() + 15
        while True:
            ld = httpx.get(f"{url}/v1/loads", timeout=5).json()
            if (
                ld["kv_pages_free"] == ld["kv_pages_total"]
                and ld["kv_slots_free"] == ld["kv_slots_total"]
                and sum(ld["queues"].values()) == 0
            ):
                break
            assert time.monotonic() < deadline, f"{url} still holds state: {ld}"
            time.sleep(0.05)
