"""DeepSeek-V4 PD with prefill's prefix cache (v4-tiny over the fake fabric): prefill resumes
repeated prefixes from its pages and slot-row snapshots, decode still receives the whole state
(every page, the slot row at the prompt's end) and generates exactly what a monolithic engine
without a cache generates; the client's cached_tokens comes through decode; every page, slot
row and snapshot comes back on both sides. A growing conversation over PD re-prefills only
its previous answer and new turn (decode's generated tokens never reach prefill's cache)."""

from __future__ import annotations

import random

import pytest

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from test_state_machines import Pair

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engines(make_model):
    model = make_model("v4-tiny")

    def make(role: str, cache: bool = True) -> Engine:
        return Engine(
            EngineArgs(
                model=str(model),
                role=role,
                device="cpu",
                kernel_backend="cpu",
                kv_pages=40,
                page_size=8,
                max_num_seqs=4,
                max_num_batched_tokens=64,
                served_model_name="m",
                enable_prefix_cache=cache,
                prefix_cache_snapshots=4,
                # the transfer path under test: decode serving repeats itself is test_decode_local_continuation's
                decode_local_prefill=0,
            )
        )

    return make("prefill"), make("decode"), make("mono", cache=False)


@pytest.fixture
def pair(engines):
    p = Pair(engines)
    yield p
    p.close()


def mono(engines, prompt: list[int], n: int) -> list[int]:
    from test_state_machines import mono_tokens

    return mono_tokens(engines, prompt, max_tokens=n)


def test_prefill_resumes_v4_prefixes_and_decode_equals_mono(pair, engines):
    p, d, _ = engines
    assert p.prefix_cache is not None and p.prefix_cache.snapshots is not None and d.prefix_cache is None
    rng = random.Random(4)
    system = [rng.randrange(5, 250) for _ in range(37)]  # boundary 8: snapshots at 32 and past
    prompts = [system + [rng.randrange(5, 250) for _ in range(k)] for k in (1, 3, 9, 0, 17)]
    prompts.append(list(prompts[2]))  # an exact repeat
    hits = []
    for prompt in prompts:
        _, pc, _, dc = pair.both(prompt=prompt, max_tokens=9)
        pair.run_until(lambda: dc.ends)
        assert pc.end.error is None and dc.end.finish_reason == "length", dc.end.error
        assert dc.tokens == mono(engines, prompt, 9)
        hits.append(dc.end.cached_tokens)  # decode reports what prefill's cache served
    assert hits[0] == 0 and all(h >= 32 for h in hits[1:4]), hits
    assert hits[5] == (len(prompts[2]) - 1) // 8 * 8, hits  # the repeat resumes at its last boundary
    assert p.prefix_cache.stats()["snapshots_restored"] >= 4
    pair.assert_clean("p", "d")
    p.prefix_cache.check()
    assert p.pool.slots.num_free == p.pool.num_slots and d.pool.slots.num_free == d.pool.num_slots


def test_growing_conversation_over_pd_recomputes_only_the_answer_and_new_turn(pair, engines):
    """Round N+1 = round N's prompt + decode's answer + a new turn. Prefill's cache holds round
    N's prompt (to its last boundary); the answer was computed on decode only, so prefill
    recomputes it: at most one boundary of round N's prompt plus the answer plus the new turn."""
    rng = random.Random(8)
    convo = [rng.randrange(5, 250) for _ in range(20)]
    prev_len = 0
    for rnd in range(4):
        prompt = list(convo)
        _, pc, _, dc = pair.both(prompt=prompt, max_tokens=6)
        pair.run_until(lambda: dc.ends)
        assert dc.end.finish_reason == "length", dc.end.error
        assert dc.tokens == mono(engines, prompt, 6), rnd
        assert dc.end.cached_tokens >= prev_len - 8, (rnd, dc.end.cached_tokens, prev_len)
        prev_len = len(prompt)
        convo += dc.tokens + [rng.randrange(5, 250) for _ in range(7)]
    pair.assert_clean("p", "d")
