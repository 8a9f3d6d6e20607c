"""n > 1 inside a real engine (tiny preset): the choices of one request reuse the first choice's
prompt pages, so the prompt is computed once (plus each other choice's tail); each choice samples
what a lone request with its seed samples; every page comes back, with aborts and preemption."""

from __future__ import annotations

import random
from typing import Optional

import pytest

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence

PS = 4
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def engine_for(model, cache: bool = True, **kw) -> Engine:
    args = dict(
        model=str(model),
        device="cpu",
        kernel_backend="cpu",
        page_size=PS,
        kv_pages=64,
        max_num_seqs=8,
        max_num_batched_tokens=16,
        enable_prefix_cache=cache,
    )
    args.update(kw)
    return Engine(EngineArgs(**args))


def counting(engine: Engine) -> list[int]:
    """Tokens computed per step (the runner's batches), recorded as the engine runs."""
    computed: list[int] = []
    step = engine.runner.step

    def counted(batch, pool):
        computed.append(sum(b.num_new for b in batch))
        return step(batch, pool)

    engine.runner.step = counted
    return computed


def run(
    engine: Engine, requests: list[Sequence], aborts: Optional[dict[int, str]] = None
) -> dict[str, tuple[list[int], str]]:
    aborts = aborts or {}
    outs: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for s in requests:

        def sink(out, rid=s.rid):
            outs.setdefault(rid, []).extend(out.token_ids)
            if out.finished:
                reasons[rid] = out.finish_reason

        s.sink = sink
        engine.submit(s)
    step = 0
    while len(reasons) < len(requests):
        if step in aborts:
            engine.abort(aborts[step])
        engine.step()
        step += 1
        assert step < 2000, "engine made no progress"
    return {rid: (outs.get(rid, []), reasons[rid]) for rid in reasons}


def choices(prompt: list[int], n: int, seed: int = 7, max_tokens: int = 6) -> list[Sequence]:
    """What the HTTP process sends for one request with n choices: seed + j, choice j > 0 naming choice 0."""
    return [
        Sequence(
            f"r-{j}",
            list(prompt),
            SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + j, ignore_eos=True),
            share_prefix_of="r-0" if j else None,
        )
        for j in range(n)
    ]


@pytest.fixture(scope="module")
def lone(tiny_model) -> Engine:
    """An engine without a prefix cache for lone requests (a seeded request's tokens do not depend
    on what else ran before it)."""
    return engine_for(tiny_model, cache=False)


def assert_all_pages_back(engine: Engine) -> None:
    alloc = engine.pool.allocator
    assert not engine.seqs and not engine.scheduler.running and not engine.scheduler.waiting
    assert alloc._refs == {}, f"pages still referenced: {alloc._refs}"
    assert alloc.num_free == engine.pool.num_pages
    if engine.prefix_cache is not None:
        engine.prefix_cache.check()


@pytest.mark.parametrize("length", [32, 3])  # a prompt ending on a page boundary; one shorter than a page
def test_choices_share_the_prompt_and_sample_what_lone_seeded_requests_sample(tiny_model, lone, length):
    prompt = [random.Random(length).randrange(3, 400) for _ in range(length)]
    n, max_tokens = 4, 6
    engine = engine_for(tiny_model)
    computed = counting(engine)
    got = run(engine, choices(prompt, n, max_tokens=max_tokens))
    shared = (length - 1) // PS * PS  # full pages before the last token
    # the prompt once, each other choice its tail, then every choice's decode steps
    assert sum(computed) == length + (n - 1) * (length - shared) + n * (max_tokens - 1), computed
    assert engine.prefix_cache.hit_tokens == (n - 1) * shared
    assert_all_pages_back(engine)
    for j in range(n):  # a lone request with choice j's seed, on a fresh engine without a cache
        alone = run(lone, [choices(prompt, j + 1, max_tokens=max_tokens)[j]])
        assert got[f"r-{j}"] == alone[f"r-{j}"], j
    assert len({tuple(got[f"r-{j}"][0]) for j in range(n)}) > 1  # seeds differ: so do the choices


def test_without_a_prefix_cache_choices_run_side_by_side(tiny_model):
    prompt = list(range(10, 40))
    engine = engine_for(tiny_model, cache=False)
    computed = counting(engine)
    got = run(engine, choices(prompt, 3, max_tokens=4))
    assert sum(computed) == 3 * 30 + 3 * 3
    cached = run(engine_for(tiny_model), choices(prompt, 3, max_tokens=4))
    assert got == cached
    assert_all_pages_back(engine)


def test_v4_choices_prefill_side_by_side_and_sample_what_lone_seeded_requests_sample(make_model):
    """DeepSeek-V4 has no prefix cache (slot state): each choice prefills; the seeds still hold."""
    v4 = make_model("v4-tiny")
    prompt = [random.Random(4).randrange(3, 400) for _ in range(21)]
    engine = engine_for(v4, cache=False, page_size=16)
    assert engine.prefix_cache is None
    computed = counting(engine)
    got = run(engine, choices(prompt, 3, max_tokens=4))
    assert sum(computed) == 3 * 21 + 3 * 3
    assert_all_pages_back(engine)
    assert engine.pool.slots.num_free == engine.pool.num_slots
    for j in range(3):
        alone = run(engine, [choices(prompt, j + 1, max_tokens=4)[j]])
        assert got[f"r-{j}"] == alone[f"r-{j}"], j


def test_other_requests_are_admitted_while_choices_wait(tiny_model):
    engine = engine_for(tiny_model, max_num_batched_tokens=32)
    prompt = list(range(50, 90))  # 40 tokens: chunks of 32 and 8 for the first choice
    other = Sequence("other", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    seen: list[list[str]] = []
    step = engine.runner.step

    def record(batch, pool):
        seen.append([b.seq.rid for b in batch])
        return step(batch, pool)

    engine.runner.step = record
    run(engine, [*choices(prompt, 3, max_tokens=2), other])
    first_other = next(i for i, rids in enumerate(seen) if "other" in rids)
    first_sibling = next(i for i, rids in enumerate(seen) if "r-1" in rids)
    assert first_other < first_sibling, seen  # not stuck behind the held choices
    assert_all_pages_back(engine)


@pytest.mark.parametrize("abort_step", [0, 3])
def test_aborting_the_first_choice_frees_the_others_to_run(tiny_model, abort_step):
    engine = engine_for(tiny_model, max_num_batched_tokens=8)
    prompt = list(range(50, 90))
    got = run(engine, choices(prompt, 3, max_tokens=3), aborts={abort_step: "r-0"})
    assert got["r-0"][1] == "abort"
    assert got["r-1"][1] == got["r-2"][1] == "length"
    assert_all_pages_back(engine)


def test_choices_on_a_pool_that_preempts_return_every_page(tiny_model, lone):
    """14 pages of 4 tokens: four choices of a 30-token prompt plus their answers do not fit at
    once; preemption and readmission keep the outputs those of lone seeded requests."""
    prompt = [random.Random(1).randrange(3, 400) for _ in range(30)]
    engine = engine_for(tiny_model, kv_pages=14)
    seqs = choices(prompt, 4, max_tokens=12)
    got = run(engine, seqs)
    assert sum(s.num_preemptions for s in seqs) > 0, "the small pool should have forced preemption"
    assert_all_pages_back(engine)
    for j in range(4):
        alone = run(lone, [choices(prompt, j + 1, max_tokens=12)[j]])
        assert got[f"r-{j}"] == alone[f"r-{j}"], j
