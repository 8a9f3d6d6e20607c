"""Grammar compilation off the engine's step loop, with a deadline, and bounded grammars (issue
39 item 3): a grammar bomb never stalls the batch, and one over the bounds is a 400."""

from __future__ import annotations

import json
import time

import pytest

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence
from dsv4_engine.structured.spec import MAX_GRAMMAR_CHARS, MAX_REPEAT, StructuredSpec

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def chain(rules: int, tag: str = "x") -> str:
    """An EBNF grammar of `rules` chained rules: slow to compile for its size."""
    body = "\n".join(f'r{i} ::= "{tag}{i}" r{i + 1} | "y"' for i in range(rules))
    return f'root ::= r0\n{body}\nr{rules} ::= "z"'


@pytest.mark.parametrize(
    "spec",
    [
        StructuredSpec("ebnf", chain(3000)),  # > 64 KiB
        StructuredSpec("regex", "a{0,100000000}"),
        StructuredSpec("regex", "(ab){70000}"),
        StructuredSpec("ebnf", 'root ::= "a"{1,99999999}'),
        StructuredSpec("json_schema", json.dumps({"type": "string", "maxLength": 100_000_000})),
        StructuredSpec(
            "json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "array", "minItems": 10**6}}})
        ),
    ],
)
def test_grammars_over_the_bounds_are_refused(spec):
    with pytest.raises(ValueError, match=f"{MAX_GRAMMAR_CHARS}|{MAX_REPEAT}"):
        spec.check()


def test_grammars_within_the_bounds_pass():
    StructuredSpec("regex", r"[A-Z]{2}-\d{3,8}").check()
    StructuredSpec("ebnf", chain(100)).check()
    StructuredSpec("json_schema", json.dumps({"type": "string", "maxLength": 4096})).check()


def test_a_grammar_bomb_neither_stalls_the_batch_nor_runs_past_its_deadline(tiny_model):
    engine = Engine(
        EngineArgs(
            model=str(tiny_model),
            device="cpu",
            kernel_backend="cpu",
            kv_pages=256,
            page_size=8,
            grammar_compile_timeout=0.05,
        )
    )
    # warm: the first step and the vocabulary's grammar tables take their time once
    warm = Sequence("warm", [5], SamplingParams(max_tokens=2, structured=StructuredSpec("regex", "[a-z]+")))
    run(engine, [warm])
    t0 = time.monotonic()
    engine.grammars.compiler.compile(StructuredSpec("ebnf", chain(2000, "c")))  # what the bomb would cost the loop
    compile_s = time.monotonic() - t0
    bomb = Sequence("bomb", [5, 6], SamplingParams(max_tokens=4, structured=StructuredSpec("ebnf", chain(2000, "b"))))
    normal = Sequence("normal", [5, 6, 7], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    outs, longest = run(engine, [bomb, normal])
    last = outs["bomb"][-1]
    assert last.finish_reason == "error" and last.error_code == 400 and "did not compile within" in last.error
    assert sum(len(o.token_ids) for o in outs["normal"]) == 16 and outs["normal"][-1].finish_reason == "length"
    assert not engine.seqs and engine.pool.allocator.num_free == engine.pool.num_pages
    print(f"longest step {longest:.3f}s; the bomb's compile {compile_s:.3f}s")
    assert longest < 0.5 * compile_s, (longest, compile_s)  # compiled on the step loop, a step took it all


def run(engine: Engine, seqs: list[Sequence]) -> tuple[dict, float]:
    outs: dict[str, list] = {s.rid: [] for s in seqs}
    for s in seqs:
        s.sink = outs[s.rid].append
        engine.submit(s)
    longest = 0.0
    for _ in range(2000):
        t0 = time.monotonic()
        engine.step()
        longest = max(longest, time.monotonic() - t0)
        if all(o and o[-1].finished for o in outs.values()):
            break
    return outs, longest
