"""The OpenAI sampling fields over real HTTP against `dsv4 serve` (tiny model): logit_bias,
min_tokens, presence/frequency/repetition penalties change what is generated as they say,
best_of equal to n is accepted (n and best_of themselves: test_n_choices_http), and every value we cannot honour gets an OpenAI 400 naming its
field. Then the same fields through the router to a prefill and a decode engine: the first
token is sampled on prefill, the rest on decode, and PD must give what mono gives."""

from __future__ import annotations

import httpx
import pytest

from bench.harness.commands import Proc, free_port, serving, stop_all

EOS = 1  # the tiny checkpoint's eos_token_id
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with serving(
        ["--model", tiny_model, "--kv-pages", 256, "--served-model-name", "tiny"],
        tmp_path_factory.mktemp("sampling") / "engine.log",
    ) as url:
        yield url


def complete(url: str, **body) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "return_token_ids": True, **body}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def tokens(url: str, **body) -> list[int]:
    r = complete(url, **body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_logit_bias_forces_and_bans_tokens(server):
    plain = tokens(server, ignore_eos=True)
    forced = next(t for t in range(5, 200) if t not in plain)
    assert tokens(server, ignore_eos=True, logit_bias={str(forced): 100}) == [forced] * 12
    banned = tokens(server, ignore_eos=True, logit_bias={str(plain[0]): -100})
    assert banned[0] != plain[0]
    # chat, sampled (not greedy), with a seed: the bias still wins
    r = httpx.post(
        f"{server}/v1/chat/completions",
        timeout=120,
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "temperature": 1.0,
            "seed": 3,
            "ignore_eos": True,
            "return_token_ids": True,
            "logit_bias": {str(forced): 100},
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == [forced] * 5


def test_logprobs_are_the_models_raw_ones(server):
    plain = complete(server, ignore_eos=True, max_tokens=1, logprobs=1).json()["choices"][0]
    forced = next(t for t in range(5, 200) if t != plain["token_ids"][0])
    biased = complete(server, ignore_eos=True, max_tokens=1, logprobs=1, logit_bias={str(forced): 100}).json()[
        "choices"
    ][0]
    assert biased["token_ids"] == [forced]
    # the top alternative is still the model's favourite, with the logprob the model gave it
    top_tok, top_lp = max(plain["logprobs"]["top_logprobs"][0].items(), key=lambda kv: kv[1])
    assert top_tok in biased["logprobs"]["top_logprobs"][0]  # (beside the sampled token's own entry)
    assert biased["logprobs"]["top_logprobs"][0][top_tok] == pytest.approx(top_lp, abs=1e-4)
    assert biased["logprobs"]["token_logprobs"][0] < plain["logprobs"]["token_logprobs"][0]


def test_min_tokens_holds_eos_back(server):
    eager = complete(server, logit_bias={str(EOS): 100}).json()["choices"][0]
    assert eager["finish_reason"] == "stop" and eager["token_ids"] in ([], [EOS])
    held = complete(server, logit_bias={str(EOS): 100}, min_tokens=4).json()["choices"][0]
    assert held["finish_reason"] == "stop"
    assert held["token_ids"][4:] in ([], [EOS]) and EOS not in held["token_ids"][:4], held
    stop_id = tokens(server, ignore_eos=True)[0]
    held = complete(server, stop_token_ids=[stop_id], min_tokens=3, ignore_eos=True, max_tokens=3).json()["choices"][0]
    assert stop_id not in held["token_ids"] and held["finish_reason"] == "length"


def test_stop_strings_wait_for_min_tokens(server):
    """As vLLM: a stop string that shows up before min_tokens are out does not end the request."""
    plain = complete(server, ignore_eos=True).json()["choices"][0]
    stop = next(plain["text"][i : i + 2] for i in range(len(plain["text"]) - 1) if plain["text"][i : i + 2].strip())
    early = complete(server, ignore_eos=True, stop=[stop]).json()["choices"][0]
    assert early["finish_reason"] == "stop" and len(early["token_ids"]) < 12, (stop, early)
    held = complete(server, ignore_eos=True, stop=[stop], min_tokens=12).json()["choices"][0]
    assert held["finish_reason"] == "length" and held["token_ids"] == plain["token_ids"], held


def test_penalties_change_repetition(server):
    plain = tokens(server, ignore_eos=True, max_tokens=24)
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself when greedy
    presence = tokens(server, ignore_eos=True, max_tokens=24, presence_penalty=2.0)
    frequency = tokens(server, ignore_eos=True, max_tokens=24, frequency_penalty=2.0)
    repetition = tokens(server, ignore_eos=True, max_tokens=24, repetition_penalty=5.0)
    for out in (presence, frequency, repetition):
        assert out != plain and len(set(out)) > len(set(plain)), (plain, out)
    assert (
        tokens(
            server,
            ignore_eos=True,
            max_tokens=24,
            presence_penalty=0,
            frequency_penalty=0,
            repetition_penalty=1,
            best_of=1,
            min_tokens=0,
        )
        == plain
    )


@pytest.mark.parametrize(
    "body,param",
    [
        ({"logit_bias": {"999999": 5}}, "logit_bias"),
        ({"logit_bias": {"five": 5}}, "logit_bias"),
        ({"logit_bias": {"-3": 5}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"5": "up"}}, "logit_bias.5"),
        ({"logit_bias": [5]}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1}, "repetition_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 13}, "min_tokens"),  # above max_tokens (12)
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"best_of": 0}, "best_of"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(server, body, param):
    for path, base in (
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        r = httpx.post(f"{server}{path}", json={**base, "max_tokens": 12, **body}, timeout=60)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err


# ---- PD: the first token is sampled on prefill, the rest on decode ----------------------------


@pytest.fixture(scope="module")
def pd(tiny_model, tmp_path_factory, server):
    tmp = tmp_path_factory.mktemp("sampling-pd")
    p_port, b_port, d_port, r_port = (free_port() for _ in range(4))
    common = ["--model", tiny_model, "--kv-pages", 128, "--page-size", 16, "--served-model-name", "tiny"]
    procs = [
        Proc(
            ["serve", *common, "--role", "prefill", "--port", p_port, "--bootstrap-port", b_port], tmp / "prefill.log"
        ),
        Proc(["serve", *common, "--role", "decode", "--port", d_port], tmp / "decode.log"),
    ]
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    procs.append(
        Proc(
            ["router", "--prefill", p_url, "--decode", d_url, "--port", r_port, "--health-interval", "0.5"],
            tmp / "router.log",
        )
    )
    try:
        for url, proc in zip((p_url, d_url, f"http://127.0.0.1:{r_port}"), procs):
            proc.wait_ready(url)
        yield f"http://127.0.0.1:{r_port}"
    finally:
        stop_all(procs)


def _first_three_not_eos(toks):
    return len(toks) == 4 and EOS not in toks[:3] and toks[3] == EOS  # held back 3 times, then forced


@pytest.mark.parametrize(
    "fields,shows",
    [
        ({"logit_bias": {"7": 100}}, lambda toks: toks == [7] * 10),  # the first token (prefill) and the rest (decode)
        (
            {"logit_bias": {str(EOS): 100}, "min_tokens": 3, "ignore_eos": False},
            _first_three_not_eos,
        ),  # prefill holds EOS back too
        (
            {"presence_penalty": 2.0, "frequency_penalty": 1.0, "repetition_penalty": 1.5},
            None,
        ),  # decode counts prefill's token
        ({"temperature": 0.9, "seed": 11, "presence_penalty": 1.0, "logit_bias": {"9": 4}}, None),
    ],
)
def test_pd_samples_what_mono_samples(pd, server, fields, shows):
    body = {"ignore_eos": True, "max_tokens": 10, **fields}
    mono = complete(server, **body)
    split = complete(pd, **body)
    assert mono.status_code == split.status_code == 200, (mono.text, split.text)
    toks = split.json()["choices"][0]["token_ids"]
    assert toks == mono.json()["choices"][0]["token_ids"]
    assert split.json()["choices"][0]["finish_reason"] == mono.json()["choices"][0]["finish_reason"]
    assert (
        shows(toks)
        if shows
        else toks
        != tokens(
            pd,
            **{
                **body,
                **{k: 0 for k in ("presence_penalty", "frequency_penalty")},
                "repetition_penalty": 1,
                "logit_bias": {},
            },
        )
    )
