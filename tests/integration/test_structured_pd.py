"""Structured outputs under PD (real NIXL, real router; V3 and V4 tiny checkpoints): prefill samples the first token under
the grammar, decode rebuilds the grammar state from the request and accepts that token once;
PD output equals the monolithic engine's, token for token, and is schema-valid JSON. A
refused grammar is the same 400 through the router."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from test_pd import PDCluster, complete, loads

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 500},
        "kind": {"enum": ["a", "bb", "ccc"]},
        "xs": {"type": "array", "items": {"type": "number", "minimum": -3, "maximum": 3}, "maxItems": 3},
        "name": {"type": "string", "pattern": "^[a-z]{2,5}$"},
    },
    "required": ["id", "kind", "xs", "name"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module", params=["tiny", "v4-tiny"])
def cluster(request, make_model, tmp_path_factory):
    c = PDCluster(make_model(request.param), tmp_path_factory.mktemp(f"pd-structured-{request.param}"))
    yield c
    c.stop()


@pytest.mark.parametrize(
    "extra",
    [
        {"temperature": 0},
        {"temperature": 1.0, "seed": 7},  # decode continues prefill's seeded stream
        {"temperature": 0, "guided_choice": ["left", "right"]},  # the first token may be the whole answer's start
    ],
)
def test_pd_equals_mono_under_a_grammar(cluster, extra):
    extra = {**extra}
    if "guided_choice" not in extra:
        extra["response_format"] = FORMAT
    moved = loads(cluster.p_url)["counters"].get("kv_transfers_completed", 0)
    for prompt in ("describe it:", [5, 9, 13, 200, 77]):
        pd = complete(cluster.r_url, prompt, max_tokens=100, ignore_eos=False, **extra)
        mono = complete(cluster.m_url, prompt, max_tokens=100, ignore_eos=False, **extra)
        assert pd["choices"][0]["token_ids"] == mono["choices"][0]["token_ids"]
        assert pd["choices"][0]["finish_reason"] == mono["choices"][0]["finish_reason"] == "stop"
        text = pd["choices"][0]["text"]
        if "guided_choice" in extra:
            assert text in ("left", "right")
        else:
            jsonschema.validate(json.loads(text), SCHEMA)
    assert loads(cluster.p_url)["counters"].get("kv_transfers_completed", 0) >= moved + 2  # both went through PD


def test_refused_grammar_is_a_400_through_the_router(cluster):
    r = httpx.post(
        f"{cluster.r_url}/v1/completions", json={"prompt": "x", "max_tokens": 8, "guided_regex": "(["}, timeout=60
    )
    assert r.status_code == 400 and "regex" in r.json()["error"]["message"], r.text
