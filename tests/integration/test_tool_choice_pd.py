"""A streamed `tool_choice: "required"` call through the router over a real prefill/decode pair
(NIXL) equals the monolithic engine's, on V3 and V4 tiny checkpoints: prefill samples the first
token under the tool-call grammar, decode rebuilds the matcher from the same spec and the tokens
so far."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from test_pd import PDCluster

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "shell",
            "parameters": {
                "type": "object",
                "properties": {
                    "cmd": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                    "n": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["cmd", "n"],
                "additionalProperties": False,
            },
        },
    }
]


@pytest.fixture(scope="module", params=["tiny", "v4-tiny"])
def cluster(request, make_model, tmp_path_factory):
    c = PDCluster(make_model(request.param), tmp_path_factory.mktemp(f"pd-tools-{request.param}"))
    yield c
    c.stop()


def streamed(url: str, body: dict) -> tuple[list[dict], str]:
    calls: dict[int, dict] = {}
    finish = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for ch in json.loads(line[6:])["choices"]:
                finish = ch.get("finish_reason") or finish
                for d in ch["delta"].get("tool_calls") or []:
                    c = calls.setdefault(d["index"], {"name": None, "arguments": ""})
                    c["name"] = (d.get("function") or {}).get("name") or c["name"]
                    c["arguments"] += (d.get("function") or {}).get("arguments") or ""
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{"temperature": 0}, {"temperature": 1.0, "seed": 5}])
def test_streamed_tool_call_through_pd_equals_mono(cluster, extra):
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "list files"}],
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 250,
        **extra,
    }
    pd, pd_finish = streamed(cluster.r_url, body)
    mono, mono_finish = streamed(cluster.m_url, body)
    assert pd == mono and pd_finish == mono_finish == "tool_calls"
    assert len(pd) == 1 and pd[0]["name"] == "shell"
    jsonschema.validate(json.loads(pd[0]["arguments"]), TOOLS[0]["function"]["parameters"])
    named = {**body, "stream": False, "tool_choice": {"type": "function", "function": {"name": "shell"}}}
    a = httpx.post(f"{cluster.r_url}/v1/chat/completions", json=named, timeout=300).json()
    b = httpx.post(f"{cluster.m_url}/v1/chat/completions", json=named, timeout=300).json()
    strip = lambda m: [(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
    assert strip(a["choices"][0]["message"]) == strip(b["choices"][0]["message"])
    assert a["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.slow
def test_auto_through_pd_equals_mono(cluster):
    """`tool_choice: "auto"` (free text, then a call block) through the router equals mono, token
    for token: prefill and decode compile the same structural tag. The marker tokens are biased so
    the random model opens a call."""
    from dsv4_wire import chat_tokens as T

    tok = json.loads((cluster.model / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    bias = {str(added[m]): b for m, b in ((T.DSML, 30), (T.TOOL_CALLS_BEGIN, 5)) if m in added}
    bias[str(tok["model"]["vocab"]["<"])] = 4
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "list files"}],
        "tools": TOOLS,
        "tool_choice": "auto",
        "max_tokens": 250,
        "temperature": 1.0,
        "logit_bias": bias,
        "stream": False,
    }
    for seed in (1, 2, 3):
        a = httpx.post(f"{cluster.r_url}/v1/chat/completions", json={**body, "seed": seed}, timeout=300).json()
        b = httpx.post(f"{cluster.m_url}/v1/chat/completions", json={**body, "seed": seed}, timeout=300).json()
        strip = lambda r: (
            r["choices"][0]["message"]["content"],
            [
                (c["function"]["name"], c["function"]["arguments"])
                for c in r["choices"][0]["message"].get("tool_calls") or []
            ],
            r["choices"][0]["finish_reason"],
        )
        assert strip(a) == strip(b)
        for name, args in strip(a)[1]:
            jsonschema.validate(json.loads(args), TOOLS[0]["function"]["parameters"])
