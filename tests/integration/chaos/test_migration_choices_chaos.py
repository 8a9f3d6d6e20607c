"""Migration of requests with several choices (`n` = 2) and with structured outputs, mixed with
plain streams, under a decode SIGKILL: every client gets the undisturbed run's answer.

Real processes on 127.0.0.1 (tiny model): one prefill, two decode engines and the router. An
n = 2 stream that breaks goes on as one n = 1 continuation per unfinished choice (seed + j); a
json_schema stream's continuation rebuilds its grammar state from the tokens so far (on the
prefill that recomputes them and on the decode that receives them) and ends schema-valid.
"""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest

from bench.harness.migration_chaos import Cluster, body_for, mismatches, streams, wait_idle

TOKENS = 96
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 900},
        "note": {"type": "string", "pattern": "^[a-z ]{50,70}$"},
        "kind": {"enum": ["a", "bb", "ccc"]},
    },
    "required": ["id", "note", "kind"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}


@pytest.fixture
def cluster(tiny_model, tmp_path):
    c = Cluster(tiny_model, tmp_path, decodes=2)
    yield c
    c.stop()


def _bodies(count: int) -> tuple[list[dict], list[dict], dict[str, list[int]]]:
    """Completions (plain greedy streams; n = 2 seeded sampling streams; json_schema greedy
    streams; n = 2 seeded non-streamed) and n = 2 seeded chat streams; the kinds' positions."""
    comp, kinds = [], {"plain": [], "n2": [], "structured": [], "n2_unstreamed": []}
    for i in range(count):
        kind = ("plain", "n2", "structured", "n2_unstreamed")[i % 4]
        kinds[kind].append(i)
        if kind == "plain":
            b = body_for(i, TOKENS)
        elif kind == "structured":
            b = body_for(i, 160, ignore_eos=False, response_format=FORMAT)
        else:
            b = body_for(i, TOKENS, n=2, temperature=0.9, seed=500 + i)
            if kind == "n2_unstreamed":
                b.pop("stream_options")
                b["stream"] = False
        comp.append(b)
    chat = [body_for(i, TOKENS, chat=True, n=2, temperature=0.9, seed=900 + i) for i in range(6)]
    return comp, chat, kinds


def _moved_ids(router_log: str) -> set[str]:
    return set(re.findall(r"request (\S+): migrations=", router_log))


@pytest.mark.slow  # ~65 s on 2 shared cores: 34 requests, three rounds
def test_n2_structured_and_plain_streams_survive_a_decode_sigkill(cluster):
    c = cluster
    comp, chat, kinds = _bodies(28)
    want, want_chat = streams(c.r_url, comp), streams(c.r_url, chat, chat=True)
    assert all(w.ok for w in want + want_chat), [w.error for w in want + want_chat if not w.ok]
    for i in kinds["n2"] + kinds["n2_unstreamed"]:
        assert set(want[i].texts) == {0, 1} and want[i].usage["completion_tokens"] == 2 * TOKENS
        assert want[i].texts[0] != want[i].texts[1]  # seed + j: two different answers
    for i in kinds["structured"]:
        assert want[i].finish == "stop", want[i].texts
        jsonschema.validate(json.loads(want[i].text), SCHEMA)

    box: dict = {}
    t = threading.Thread(target=lambda: box.update(comp=streams(c.r_url, comp)))
    t2 = threading.Thread(target=lambda: box.update(chat=streams(c.r_url, chat, chat=True)))
    t.start()
    t2.start()
    try:
        c.wait_running("decode0", 8)
        time.sleep(0.15)  # mid-stream: tokens are out (a decode step is a few ms)
        c.kill("decode0")
    finally:
        t.join(180)
        t2.join(180)
    assert not t.is_alive() and not t2.is_alive(), "a client hangs\n" + c.logs()
    got, got_chat = box["comp"], box["chat"]

    bad = (
        mismatches([got[i] for i in kinds["plain"]], [want[i] for i in kinds["plain"]], TOKENS)
        + mismatches(
            [got[i] for i in kinds["n2"] + kinds["n2_unstreamed"]],
            [want[i] for i in kinds["n2"] + kinds["n2_unstreamed"]],
            2 * TOKENS,
        )
        + mismatches([got[i] for i in kinds["structured"]], [want[i] for i in kinds["structured"]], None)
        + mismatches(got_chat, want_chat, 2 * TOKENS)
    )
    assert not bad, "\n".join(bad[:6]) + "\n" + c.logs()
    for i in kinds["structured"]:
        jsonschema.validate(json.loads(got[i].text), SCHEMA)
    for s in got_chat:
        assert s.role_per_choice == {0: 1, 1: 1}

    # the fault hit each kind mid-answer: some of each moved (the router logs every moved request)
    moved = _moved_ids(c.router.log_path.read_text(errors="replace"))
    for kind in ("plain", "n2", "structured"):
        assert moved & {next(iter(got[i].ids)) for i in kinds[kind]}, (kind, moved)
    assert moved & {next(iter(s.ids)) for s in got_chat}, moved
    wait_idle([c.urls["prefill"], c.urls["decode1"]])
