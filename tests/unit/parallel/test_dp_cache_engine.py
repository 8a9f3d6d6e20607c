"""`--tp-size 2 --dp-size 2` with the prefix cache on (rank 0 here, rank 1 a real child process,
gloo on 127.0.0.1): conversations over one shared system prompt, two rounds each. Greedy tokens
equal `--tp-size 1` with its prefix cache on; both ranks' caches hit (counted per rank, on
/v1/loads and /metrics); each second round runs on the rank that served its first (where its
prefix is cached). Structured outputs under DP: rank 0 samples with the grammar, as at one rank.
Every run is bounded by a deadline (a rank that skipped a collective would hang)."""

from __future__ import annotations

import json
import random
import re
import threading

import jsonschema
import pytest
import torch

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence
from dsv4_engine.structured import spec as structured

NEW_TOKENS = 8
DEADLINE_S = 180.0
PAGE = 8


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_engine(model_dir, tp: int, dp: int = 1) -> Engine:
    return Engine(
        EngineArgs(
            model=str(model_dir),
            device="cpu",
            kernel_backend="cpu",
            kv_pages=32,
            page_size=PAGE,
            max_num_batched_tokens=32,
            tp_size=tp,
            dp_size=dp,
        )
    )


@pytest.fixture(scope="module")
def engines(make_model):
    model = make_model("tiny")
    ref = make_engine(model, 1)
    dp = make_engine(model, 2, 2)
    yield ref, dp
    dp.tp.close()


def bounded(fn):
    box: dict = {}

    def run():
        try:
            box["out"] = fn()
        except BaseException as e:  # reported below
            box["err"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(DEADLINE_S)
    assert not t.is_alive(), f"the data-parallel engine did not finish within {DEADLINE_S:g} s (a hang)"
    if "err" in box:
        raise box["err"]
    return box["out"]


def drive(engine: Engine, arrivals: dict[int, list[Sequence]]) -> dict:
    """Step the engine until every request finished: requests join at the steps given. Returns
    each request's tokens, its rank (--dp-size: the rank of its pages) and its cached tokens."""
    outs: dict[str, list] = {}
    rank: dict[str, int] = {}
    seqs = [s for group in arrivals.values() for s in group]
    for s in seqs:
        outs[s.rid] = []
        s.sink = outs[s.rid].append
    step = 0
    while not all(o and o[-1].finished for o in outs.values()):
        for s in arrivals.get(step, []):
            engine.submit(s)
        engine.step()
        if engine.args.dp_size > 1:
            for s in list(engine.scheduler.running):
                if s.pages:
                    rank.setdefault(s.rid, engine.pool.allocator.rank_of(s.pages[0]))
        step += 1
        assert step < 2000, "engine made no progress"
    assert engine.pool.allocator.num_free == engine.pool.allocator.total, "every page back (or idle in a cache)"
    return {
        "tokens": {rid: [t for o in v for t in o.token_ids] for rid, v in outs.items()},
        "reasons": {rid: v[-1].finish_reason for rid, v in outs.items()},
        "rank": rank,
        "cached": {s.rid: s.num_cached_tokens for s in seqs},
    }


def greedy(rid: str, prompt: list[int]) -> Sequence:
    return Sequence(rid, prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))


def conversations(engine: Engine) -> tuple[dict, dict]:
    """Four conversations over one 16-token system prompt (2 pages), arriving in pairs; then each
    one's second round (its first round, the answer, a new user turn), all at once."""
    rng = random.Random(5)
    v = engine.cfg.vocab_size
    system = [rng.randrange(3, v) for _ in range(2 * PAGE)]
    users = [[rng.randrange(3, v) for _ in range(6 + i)] for i in range(4)]
    first = {f"c{i}": system + u for i, u in enumerate(users)}
    r1 = drive(
        engine,
        {0: [greedy("c0", first["c0"]), greedy("c1", first["c1"])], 3: [greedy(k, first[k]) for k in ("c2", "c3")]},
    )
    # newest first: placing by load alone would put c3's second round on rank 0, c2's on rank 1...
    second = [greedy(f"{k}.2", p + r1["tokens"][k] + [rng.randrange(3, v) for _ in range(5)]) for k, p in first.items()]
    r2 = drive(engine, {0: second[::-1]})
    return r1, r2


def metric(text: str, name: str, rank: int) -> float:
    m = re.search(rf'^dsv4:{name}{{dp_rank="{rank}",[^}}]*}} (\S+)$', text, re.M)
    assert m, f"no {name} series for rank {rank}"
    return float(m.group(1))


def test_dp2_with_a_prefix_cache_per_rank_equals_tp1_and_a_second_round_finds_its_rank(engines):
    ref_engine, e = engines
    ref1, ref2 = conversations(ref_engine)
    got1, got2 = bounded(lambda: conversations(e))
    assert got1["tokens"] == ref1["tokens"] and got2["tokens"] == ref2["tokens"]
    assert set(got1["rank"].values()) == {0, 1}, got1["rank"]  # the first rounds spread over both ranks
    for k, r in got1["rank"].items():
        assert got2["rank"][f"{k}.2"] == r, (got1["rank"], got2["rank"])
        assert got2["cached"][f"{k}.2"] > 2 * PAGE, (
            "a second round reuses its own first round, not only the system prompt"
        )
    loads = e.loads()
    ranks = loads["prefix_cache"]["ranks"]
    assert loads["prefix_cache"]["enabled"] and all(r["hit_tokens"] > 0 for r in ranks), ranks
    assert sum(r["hit_tokens"] for r in ranks) == loads["prefix_cache"]["hit_tokens"]
    assert [r["prefix_cache_hit_tokens"] for r in loads["dp_ranks"]] == [r["hit_tokens"] for r in ranks]
    assert all(r["kv_pages_cached"] > 0 and r["running"] == 0 for r in loads["dp_ranks"])
    e.update_gauges()
    text = e.metrics.render().decode()
    for r in (0, 1):
        assert metric(text, "dp_rank_prefix_cache_hit_tokens_total", r) == ranks[r]["hit_tokens"]
        assert metric(text, "dp_rank_prefix_cache_pages", r) == loads["dp_ranks"][r]["kv_pages_cached"]
        assert metric(text, "dp_rank_kv_pages_free", r) == 32 and metric(text, "dp_rank_running_reqs", r) == 0
    e.prefix_cache.check()
    print(f"ranks {got1['rank']} -> {got2['rank']}; per-rank hits {[r['hit_tokens'] for r in ranks]}")


@pytest.mark.slow
def test_structured_outputs_under_dp2_follow_the_grammar_and_equal_tp1(engines):
    ref_engine, e = engines
    schema = {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["red", "blue"]}},
        "required": ["id", "tag"],
        "additionalProperties": False,
    }

    def batch() -> dict[int, list[Sequence]]:
        seqs = [
            Sequence(
                f"j{i}",
                [5 + i, 6, 7, 8 + i],
                SamplingParams(
                    max_tokens=60,
                    temperature=0 if i % 2 == 0 else 1.0,
                    seed=i,
                    structured=structured.json_schema(schema),
                ),
            )
            for i in range(4)
        ]
        seqs.append(
            Sequence(
                "re",
                [9, 10],
                SamplingParams(
                    max_tokens=30, temperature=0, structured=structured.StructuredSpec("regex", r"[a-f]{3}-[0-9]{2}")
                ),
            )
        )
        return {0: seqs[:2], 2: seqs[2:]}

    ref = drive(ref_engine, batch())
    got = bounded(lambda: drive(e, batch()))
    assert set(got["rank"].values()) == {0, 1}, "structured requests ran on both ranks"
    assert got["tokens"] == ref["tokens"]
    for i in range(4):
        assert got["reasons"][f"j{i}"] == "stop"
        jsonschema.validate(json.loads(e.tokenizer.decode(got["tokens"][f"j{i}"])), schema)
    assert re.fullmatch(r"[a-f]{3}-[0-9]{2}", e.tokenizer.decode(got["tokens"]["re"]))
