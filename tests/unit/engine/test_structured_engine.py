"""Structured outputs in the engine, on random-weight V3 (tiny) and V4 (v4-tiny) checkpoints,
driven step by step in-process:
- a property test: for generated JSON schemas (nested objects, arrays, enums, required,
  additionalProperties false, string patterns, number ranges) every output is JSON that the
  `jsonschema` library accepts, greedy and sampled, batched together;
- a grammar that admits every text leaves greedy and seeded output unchanged;
- regex and choice hold; max_tokens mid-JSON ends with "length"; an uncompilable grammar is
  refused (400) before any compute; preemption rebuilds the grammar state from the output so
  far (same output as without); the state goes when the request ends or is aborted."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence
from dsv4_engine.structured import spec as structured

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def gen_schema(rng: random.Random, depth: int = 0) -> dict:
    """A random schema whose every instance is short (bounded strings, arrays and numbers), so
    a random model completes it within a few dozen tokens."""
    kinds = ["integer", "number", "string", "enum", "boolean", "null"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 200)}
    if kind == "number":
        lo = rng.choice([-2.5, 0, 1, 10])
        return {"type": "number", "minimum": lo, "maximum": lo + rng.choice([1, 5.5, 100])}
    if kind == "string":
        return rng.choice(
            [
                {"type": "string", "pattern": "^[a-z]{1,6}$"},
                {"type": "string", "pattern": "^[A-Z][0-9]{2}$"},
                {"type": "string", "minLength": 1, "maxLength": 4},
            ]
        )
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, True, None], rng.randint(1, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null":
        return {"type": "null"}
    if kind == "array":
        lo = rng.randint(0, 1)
        return {
            "type": "array",
            "items": gen_schema(rng, depth + 1),
            "minItems": lo,
            "maxItems": lo + rng.randint(0, 2),
        }
    names = rng.sample(["id", "name", "tags", "score", "meta", "ok", "x"], rng.randint(1, 3))
    props = {n: gen_schema(rng, depth + 1) for n in names}
    return {
        "type": "object",
        "properties": props,
        "required": rng.sample(names, rng.randint(1, len(names))),
        "additionalProperties": False,
    }


def object_schema(rng: random.Random) -> dict:
    s = gen_schema(rng, 1 if rng.random() < 0.5 else 0)
    if s.get("type") != "object":
        s = {"type": "object", "properties": {"v": s}, "required": ["v"], "additionalProperties": False}
    return s


def run(engine: Engine, seqs: list[Sequence], steps: int = 600) -> dict:
    outs: dict[str, list] = {s.rid: [] for s in seqs}
    for s in seqs:
        s.sink = outs[s.rid].append
        engine.submit(s)
    for _ in range(steps):
        engine.step()
        if all(o and o[-1].finished for o in outs.values()):
            break
    assert all(o and o[-1].finished for o in outs.values()), {k: v[-1:] for k, v in outs.items()}
    assert not engine.seqs and engine.pool.allocator.num_free == engine.pool.num_pages
    assert all(s.matcher is None for s in seqs)  # the grammar state went with the request
    return outs


def tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def text(engine: Engine, outs: list) -> str:
    return engine.tokenizer.decode(tokens(outs))


def _engine(path, **kw) -> Engine:
    args = dict(model=str(path), device="cpu", kernel_backend="cpu", kv_pages=512, page_size=8)
    return Engine(EngineArgs(**{**args, **kw}))


@pytest.fixture(scope="module", params=["tiny", "v4-tiny"])
def engine(request, make_model):
    return _engine(make_model(request.param))


@pytest.fixture(scope="module")
def v3(tiny_model):
    return _engine(tiny_model)


def test_generated_schemas_always_yield_valid_json(engine):
    rng = random.Random(23)
    n = 24 if engine.runner.model_type == "deepseek_v3" else 12
    schemas = [object_schema(rng) for _ in range(n)]
    seqs = []
    for i, schema in enumerate(schemas):
        greedy = i % 2 == 0
        params = SamplingParams(
            max_tokens=200, temperature=0 if greedy else 1.0, seed=i, structured=structured.json_schema(schema)
        )
        seqs.append(Sequence(f"s{i}", [5 + i, 6, 7], params))
    outs = run(engine, seqs)
    for i, schema in enumerate(schemas):
        last = outs[f"s{i}"][-1]
        out_text = text(engine, outs[f"s{i}"])
        assert last.finish_reason == "stop", (schema, out_text)
        jsonschema.validate(json.loads(out_text), schema)


def test_a_grammar_that_admits_every_text_changes_nothing(v3):
    # Our tokenizer's single bytes >= 0x80 are not text on their own (a grammar over characters
    # forbids them, and the special tokens but EOS): both runs keep away from them by bias.
    tok = v3.tokenizer
    not_text = {
        i: -100.0
        for i in range(v3.cfg.vocab_size)
        if i not in v3.eos_ids and ("\ufffd" in tok.decode([i]) or i in (0, 2, 3))
    }
    anything = structured.StructuredSpec("regex", r"[\s\S]*")
    for temp, seed in ((0, None), (0.9, 11)):

        def req(rid, spec):
            return Sequence(
                rid,
                [9, 10, 11, 12],
                SamplingParams(max_tokens=24, temperature=temp, seed=seed, logit_bias=not_text, structured=spec),
            )

        outs = run(v3, [req("free", None), req("any", anything)])
        assert tokens(outs["any"]) == tokens(outs["free"]) and len(tokens(outs["free"])) > 3


def test_regex_and_choice_hold(v3):
    seqs = [
        Sequence(
            f"r{i}",
            [5, 6 + i],
            SamplingParams(
                max_tokens=40,
                temperature=1.0,
                seed=i,
                structured=structured.StructuredSpec("regex", r"[a-f]{3}-[0-9]{2,4}"),
            ),
        )
        for i in range(4)
    ]
    seqs += [
        Sequence(
            f"c{i}",
            [7, 8 + i],
            SamplingParams(
                max_tokens=40, temperature=1.0, seed=i, structured=structured.choice(["north", "south", "east west"])
            ),
        )
        for i in range(4)
    ]
    outs = run(v3, seqs)
    for i in range(4):
        assert (
            re.fullmatch(r"[a-f]{3}-[0-9]{2,4}", text(v3, outs[f"r{i}"])) and outs[f"r{i}"][-1].finish_reason == "stop"
        )
        assert text(v3, outs[f"c{i}"]) in ("north", "south", "east west")


def test_max_tokens_mid_json_ends_with_length(v3):
    spec = structured.json_schema({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]})
    outs = run(v3, [Sequence("short", [5, 6], SamplingParams(max_tokens=4, temperature=0, structured=spec))])
    assert outs["short"][-1].finish_reason == "length" and len(tokens(outs["short"])) == 4


def test_an_uncompilable_grammar_is_refused_before_any_compute(v3):
    before = v3.metrics.totals.get("generation_tokens", 0)
    bad = Sequence(
        "bad",
        [5, 6],
        SamplingParams(max_tokens=8, structured=structured.StructuredSpec("json_schema", '{"type": "nosuch"}')),
    )
    ok = Sequence("ok", [5, 6], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    outs = run(v3, [bad, ok])
    last = outs["bad"][-1]
    assert (
        last.finish_reason == "error" and last.error_code == 400 and "nosuch" in last.error and not tokens(outs["bad"])
    )
    assert v3.metrics.totals.get("generation_tokens", 0) - before == 3  # only the good request generated


def test_compiled_grammars_are_cached_by_spec(v3):
    spec = structured.json_schema({"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]})
    hits = v3.grammars.hits
    run(
        v3, [Sequence(f"c{i}", [5, 6], SamplingParams(max_tokens=20, temperature=0, structured=spec)) for i in range(3)]
    )
    assert v3.grammars.hits - hits >= 2


def test_preemption_rebuilds_the_grammar_state_from_the_output(tiny_model):
    schema = {
        "type": "object",
        "properties": {
            "a": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 999},
                "minItems": 10,
                "maxItems": 10,
            }
        },
        "required": ["a"],
        "additionalProperties": False,
    }
    spec = structured.json_schema(schema)

    def reqs():
        return [
            Sequence(f"p{i}", list(range(5 + i, 21 + i)), SamplingParams(max_tokens=80, temperature=0, structured=spec))
            for i in range(4)
        ]

    roomy = _engine(tiny_model)
    want = run(roomy, reqs())
    tight = _engine(
        tiny_model, kv_pages=16, enable_prefix_cache=False
    )  # 4 requests of ~50 tokens and more do not fit in 128 slots
    seqs = reqs()
    got = run(tight, seqs)
    assert sum(s.num_preemptions for s in seqs) > 0, [len(tokens(o)) for o in got.values()]
    for s in seqs:
        assert tokens(got[s.rid]) == tokens(want[s.rid])
        jsonschema.validate(json.loads(text(tight, got[s.rid])), schema)


def test_abort_frees_the_grammar_state(v3):
    spec = structured.json_schema(
        {
            "type": "object",
            "properties": {"a": {"type": "array", "items": {"type": "integer"}, "minItems": 20}},
            "required": ["a"],
        }
    )
    seq = Sequence("ab", [5, 6], SamplingParams(max_tokens=50, temperature=0, structured=spec))
    outs = []
    seq.sink = outs.append
    v3.submit(seq)
    for _ in range(4):
        v3.step()
    assert seq.matcher is not None and not seq.finished
    v3.abort("ab")
    v3.step()
    assert outs[-1].finished and outs[-1].finish_reason == "abort" and seq.matcher is None


def test_properties_come_in_the_schemas_order(v3):
    schema = {
        "type": "object",
        "properties": {"zeta": {"enum": [1]}, "alpha": {"enum": [2]}, "mid": {"enum": [3]}},
        "required": ["zeta", "alpha", "mid"],
        "additionalProperties": False,
    }
    outs = run(
        v3,
        [
            Sequence(
                "order", [5, 6], SamplingParams(max_tokens=60, temperature=0, structured=structured.json_schema(schema))
            )
        ],
    )
    assert list(json.loads(text(v3, outs["order"]))) == ["zeta", "alpha", "mid"]
