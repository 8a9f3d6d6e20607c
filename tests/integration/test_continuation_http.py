"""The engine's half of migration over real HTTP (`dsv4 serve`, tiny model): a request sent with
`continuation_token_ids` (the answer so far, from the router) goes on exactly as the undisturbed
request does -- same token ids (greedy, seeded sampling with penalties, min_tokens), the text
from where the client's text ended (stop-string hold-back included), logprob text offsets past
it, usage counting the whole answer, no second role chunk in chat -- and only the router (the PD
secret) may send one."""

from __future__ import annotations

import json

import httpx
import pytest

from bench.harness.commands import serving

SECRET = "cont-secret"
AUTH = {"Authorization": f"Bearer {SECRET}"}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with serving(
        ["--model", tiny_model, "--kv-pages", 256, "--served-model-name", "tiny"],
        tmp_path_factory.mktemp("continuation") / "engine.log",
        env={"DSV4_PD_SECRET": SECRET},
    ) as url:
        yield url


def sse(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    return [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: ") and e != "data: [DONE]"]


def stream(url: str, path: str, body: dict) -> tuple[list[dict], str, list[int]]:
    evs = sse(
        httpx.post(url + path, json={**body, "stream": True, "return_token_ids": True}, headers=AUTH, timeout=120)
    )
    text, ids = "", []
    for e in evs:
        for c in e["choices"]:
            text += c.get("text") or (c.get("delta") or {}).get("content") or ""
            ids += c.get("token_ids") or []
    return evs, text, ids


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0},
        {"temperature": 0.9, "seed": 7, "presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
        {"temperature": 0, "stop": ["zzq", "ab"], "logprobs": 2},
        {"temperature": 0.7, "seed": 3, "min_tokens": 20, "ignore_eos": False},
    ],
)
@pytest.mark.parametrize("k", [1, 9])
def test_a_continuation_goes_on_as_the_undisturbed_request(server, fields, k):
    body = {
        "prompt": [5, 6, 7, 8, 9],
        "max_tokens": 24,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        **fields,
    }
    full_evs, full_text, full_ids = stream(server, "/v1/completions", body)
    # what the client had when the first engine stopped: the events carrying the first k tokens
    seen_text, seen_ids = "", []
    for e in full_evs:
        if len(seen_ids) >= k:
            break
        for c in e["choices"]:
            seen_text += c["text"]
            seen_ids += c.get("token_ids") or []
    evs, text, ids = stream(server, "/v1/completions", {**body, "continuation_token_ids": seen_ids})
    assert seen_ids + ids == full_ids
    assert seen_text + text == full_text
    assert evs[-1]["usage"]["completion_tokens"] == len(full_ids) and evs[-1]["usage"]["prompt_tokens"] == 5
    if "logprobs" in fields:
        full_offsets = [o for e in full_evs for c in e["choices"] for o in (c["logprobs"] or {}).get("text_offset", [])]
        offsets = [o for e in evs for c in e["choices"] for o in (c["logprobs"] or {}).get("text_offset", [])]
        assert full_offsets[len(seen_ids) :] == offsets


def test_a_chat_continuation_sends_no_second_role_chunk(server):
    body = {
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    full_evs, full_text, full_ids = stream(server, "/v1/chat/completions", body)
    evs, text, ids = stream(server, "/v1/chat/completions", {**body, "continuation_token_ids": full_ids[:4]})
    assert full_ids[:4] + ids == full_ids
    assert not any("role" in (c.get("delta") or {}) for e in evs for c in e["choices"])
    assert sum("role" in (c.get("delta") or {}) for e in full_evs for c in e["choices"]) == 1


@pytest.mark.parametrize(
    "body,headers,status,param",
    [
        (
            {"continuation_token_ids": [5]},
            {},
            401,
            "continuation_token_ids",
        ),  # the router's field, behind the PD secret
        ({"continuation_token_ids": [5] * 8}, AUTH, 400, "continuation_token_ids"),  # nothing left of max_tokens
        ({"continuation_token_ids": [10**6]}, AUTH, 400, "continuation_token_ids"),
        ({"continuation_token_ids": [True]}, AUTH, 400, None),
    ],
)
def test_a_continuation_only_from_the_router_and_within_bounds(server, body, headers, status, param):
    r = httpx.post(
        f"{server}/v1/completions", json={"prompt": [5, 6], "max_tokens": 8, **body}, headers=headers, timeout=30
    )
    assert r.status_code == status, r.text
    if param:
        assert r.json()["error"]["param"] == param


SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 900},
        "note": {"type": "string", "pattern": "^[a-z ]{20,30}$"},
    },
    "required": ["id", "note"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("k", [1, 6, 17])
def test_a_structured_continuation_rebuilds_the_grammar_from_the_answer_so_far(server, k):
    """The matcher of a continuation accepts its tokens once before the first new one: the rest
    is the undisturbed answer and the whole stays schema-valid (a matcher that missed them would
    mask as at the start of the JSON and produce something else)."""
    body = {
        "prompt": [5, 6, 7, 8, 9],
        "max_tokens": 120,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}},
    }
    _, full_text, full_ids = stream(server, "/v1/completions", body)
    json.loads(full_text)
    assert len(full_ids) > k
    evs, text, ids = stream(server, "/v1/completions", {**body, "continuation_token_ids": full_ids[:k]})
    assert full_ids[:k] + ids == full_ids
    assert evs[-1]["choices"][-1]["finish_reason"] == "stop"


def test_choice_j_continued_alone_with_seed_plus_j_is_choice_j(server):
    """What the router relies on when it splits an n > 1 stream: choice j of a seeded n = 2
    request is the n = 1 request with seed + j, continued from any point."""
    body = {"prompt": [5, 6, 7], "max_tokens": 20, "temperature": 0.9, "seed": 41, "ignore_eos": True}
    evs, _, _ = stream(server, "/v1/completions", {**body, "n": 2})
    per = {0: [], 1: []}
    for e in evs:
        for c in e["choices"]:
            per[c["index"]] += c.get("token_ids") or []
    assert per[0] != per[1]
    for j in (0, 1):
        _, _, ids = stream(server, "/v1/completions", {**body, "seed": 41 + j, "continuation_token_ids": per[j][:7]})
        assert per[j][:7] + ids == per[j]
