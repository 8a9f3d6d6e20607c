"""One request's failure is that request's alone: the engine loop fails it, answers it, and keeps
serving every request batched with it. Driven step by step on the tiny model (no thread).

The bad requests here bypass the HTTP validation on purpose (it would reject them first): this
is the engine's own line of defence."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4_engine.engine import AbortRequest, AddRequest, Call, Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.sampling import SamplingError, sample
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(EngineArgs(model=str(tiny_model), device="cpu", kernel_backend="cpu", kv_pages=64, page_size=8))


def run(engine: Engine, seqs: list[Sequence], steps: int = 400) -> dict:
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
    return outs


def good(rid: str, **kw) -> Sequence:
    return Sequence(rid, [5, 6, 7, 8], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, **kw))


def test_a_seed_the_generator_refuses_fails_only_its_request(engine):
    bad = Sequence("bad-seed", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0.7, seed=2**70))
    outs = run(engine, [good("a"), bad, good("b")])
    last = outs["bad-seed"][-1]
    assert last.finish_reason == "error" and "could not be started" in last.error
    for rid in ("a", "b"):
        assert outs[rid][-1].finish_reason == "length" and outs[rid][-1].completion_tokens == 6


def test_a_failure_in_stop_handling_fails_only_its_request(engine):
    bad = Sequence("bad-stop", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    bad.params.stop = [None]  # type: ignore[list-item]  (validation would refuse it)
    outs = run(engine, [good("c"), bad, good("d")])
    assert outs["bad-stop"][-1].finish_reason == "error" and "generation failed" in outs["bad-stop"][-1].error
    assert outs["c"][-1].finish_reason == outs["d"][-1].finish_reason == "length"
    # The good ones were batched with the bad one and produced what they produce alone.
    alone = run(engine, [good("c2")])
    assert [t for o in outs["c"] for t in o.token_ids] == [t for o in alone["c2"] for t in o.token_ids]


def test_a_callback_that_raises_does_not_stop_the_inbox(engine):
    seen = []
    engine.call(lambda: 1 / 0)
    engine.call(lambda: seen.append("after"))
    outs = run(engine, [good("e")])
    assert seen == ["after"] and outs["e"][-1].finish_reason == "length"


def test_inbox_holds_typed_commands(engine):
    s = good("typed")
    engine.submit(s)
    engine.abort("typed", reason="test")
    engine.call(lambda: None)
    items = [engine.inbox.get_nowait() for _ in range(3)]
    assert [type(i) for i in items] == [AddRequest, AbortRequest, Call]
    assert items[1] == AbortRequest("typed", "test", False)
    for i in items:
        engine._handle(i)
    assert not engine.seqs and s.finished


def test_sampler_fails_a_nan_row_alone():
    logits = torch.randn(3, 50)
    logits[1, 7] = math.nan
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.0, logprobs=2),
    ]
    gens = [None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    out = sample(logits, params, gens)
    assert out[0].token == int(logits[0].argmax())
    assert isinstance(out[1], SamplingError)
    assert 0 <= out[2].token < 50 and len(out[2].logprob["top"]) == 2


def test_logprobs_are_the_raw_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    for temperature in (0.0, 0.5, 3.0):
        (r,) = sample(
            logits, [SamplingParams(temperature=temperature, top_k=2, logprobs=3)], [torch.Generator().manual_seed(0)]
        )
        ref = torch.log_softmax(logits[0], -1)
        assert r.logprob["logprob"] == pytest.approx(float(ref[r.token]))
        assert [t for t, _ in r.logprob["top"]] == [0, 1, 2]
        assert [lp for _, lp in r.logprob["top"]] == pytest.approx(ref[:3].tolist())


def test_extreme_temperatures_still_sample():
    logits = torch.randn(2, 50) * 30
    for t in (1e-30, 1e-5, 1e6, 1e300):
        out = sample(logits, [SamplingParams(temperature=t)] * 2, [torch.Generator().manual_seed(0)] * 2)
        assert all(not isinstance(o, Exception) and 0 <= o.token < 50 for o in out), (t, out)


def test_a_client_leaving_aborts_its_own_request_not_another_with_the_same_rid(engine):
    """Request ids come from clients: the second request with a taken rid is refused, and its
    client hanging up must not abort the first one, which owns the rid."""
    first = good("shared-rid")
    outs: list = []
    first.sink = outs.append
    engine.submit(first)
    engine.step()
    second = good("shared-rid")
    refused: list = []
    second.sink = refused.append
    engine.submit(second)
    engine.abort(seq=second, reason="client disconnected")  # as EngineClient does when its client leaves
    for _ in range(100):
        engine.step()
        if outs and outs[-1].finished:
            break
    assert refused[-1].finish_reason == "error" and "duplicate" in refused[-1].error
    assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 6
    engine.abort("shared-rid")  # an admin abort by rid still reaches whoever holds it (none now)
    engine.step()
    assert not engine.seqs and engine.pool.allocator.num_free == engine.pool.num_pages
