"""PD decode serves the next round of a conversation from its own prefix cache
(`--decode-local-prefill`, dsv4_engine.pd.continuation), over the in-process fabric on real tiny
engines (DeepSeek-V3 `tiny` and V4 `v4-tiny`).

Multi-round conversations (two at once): round N+1 finds round N's prompt *and answer* on decode
(cached_tokens covers them but the last boundary), prefill computes and sends nothing for it (one
transfer per conversation: its first round), every token equals a monolithic engine without a
cache, a new turn longer than the limit goes the usual way (prefill computes, transfer), and every
page, slot row and snapshot comes back on both sides. Before decode had a cache, every round was
a transfer and cached_tokens only covered what prefill's cache held (round N's prompt)."""

from __future__ import annotations

import random

import pytest

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.pd.continuation import serve_locally
from test_state_machines import Client, Pair

LIMIT = 24  # --decode-local-prefill of the decode engines below


def _engines(model, page_size: int, **extra) -> tuple[Engine, Engine, Engine]:
    def make(role: str, cache: bool = True, local: int = 0) -> Engine:
        return Engine(
            EngineArgs(
                model=str(model),
                role=role,
                device="cpu",
                kernel_backend="cpu",
                kv_pages=60,
                page_size=page_size,
                max_num_seqs=4,
                max_num_batched_tokens=64,
                served_model_name="m",
                enable_prefix_cache=cache,
                decode_local_prefill=local,
                **extra,
            )
        )

    return make("prefill"), make("decode", local=LIMIT), make("mono", cache=False)


@pytest.fixture(scope="module", params=["tiny", "v4-tiny"])
def engines(request, make_model):
    if request.param == "tiny":
        return _engines(make_model("tiny"), 8)
    return _engines(make_model("v4-tiny"), 8, prefix_cache_snapshots=8)


@pytest.fixture
def pair(engines):
    p = Pair(engines)
    yield p
    p.close()


def mono(engines, prompt: list[int], n: int) -> list[int]:
    from dsv4_engine.sampling_params import SamplingParams
    from dsv4_engine.sequence import Sequence

    client = Client()
    eng = engines[2]
    eng.submit(
        Sequence(
            rid=f"mono-{random.getrandbits(32)}",
            prompt_ids=list(prompt),
            params=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
            sink=client.outputs.append,
        )
    )
    while not client.ends:
        eng.step()
    return client.tokens


def test_serve_locally_is_a_pure_rule():
    assert serve_locally(100, 96, 8) and serve_locally(100, 92, 8)
    assert not serve_locally(100, 91, 8)  # 9 tokens left: prefill's job
    assert not serve_locally(100, 0, 1000)  # nothing held: a new conversation
    assert not serve_locally(100, 99, 0)  # off
    assert not serve_locally(100, 96, 8, continues=False)  # shares a prefix, continues no conversation


def test_rounds_resume_on_decode_with_their_answer_and_equal_mono(pair, engines):
    p, d, _ = engines
    boundary = d.prefix_cache.boundary
    rng = random.Random(11)
    convos = [[rng.randrange(5, 250) for _ in range(30 + 5 * i)] for i in range(2)]
    prev = [0, 0]
    transfers0 = pair.moved("d", "kv_transfers_completed")
    for rnd in range(4):
        started = [pair.both(prompt=list(c), max_tokens=10) for c in convos]  # two conversations at once
        pair.run_until(lambda: all(dc.ends for _, _, _, dc in started))
        for i, (_, pc, _, dc) in enumerate(started):
            prompt = convos[i]
            assert pc.end.error is None and dc.end.finish_reason == "length", dc.end.error
            assert dc.tokens == mono(engines, prompt, 10), (rnd, i)
            if rnd:
                # round N's prompt + answer (all but the last answer token has KV) is reusable
                held = prev[i] - 1
                assert dc.end.cached_tokens == held // boundary * boundary, (rnd, i, dc.end.cached_tokens, prev[i])
            prev[i] = len(prompt) + len(dc.tokens)
            convos[i] = prompt + dc.tokens + [rng.randrange(5, 250) for _ in range(6)]
    # one transfer per conversation (its first round); later rounds moved nothing
    assert pair.moved("d", "kv_transfers_completed") - transfers0 == 2
    assert pair.moved("p", "num_decode_local_reqs") == 6 and pair.moved("d", "num_decode_local_reqs") == 6
    pair.assert_clean("p", "d")
    d.prefix_cache.check()
    p.prefix_cache.check()


def test_a_long_new_turn_goes_through_prefill_and_still_equals_mono(pair, engines):
    rng = random.Random(12)
    convo = [rng.randrange(5, 250) for _ in range(33)]
    _, _, _, dc = pair.both(prompt=list(convo), max_tokens=6)
    pair.run_until(lambda: dc.ends)
    convo += dc.tokens + [rng.randrange(5, 250) for _ in range(LIMIT + 20)]  # past the limit
    before = pair.moved("d", "kv_transfers_completed")
    _, pc, _, dc = pair.both(prompt=list(convo), max_tokens=6)
    pair.run_until(lambda: dc.ends)
    assert pc.end.error is None and dc.end.finish_reason == "length", dc.end.error
    assert dc.tokens == mono(engines, convo, 6)
    assert pair.moved("d", "kv_transfers_completed") - before == 1
    # and the round after that, short again, is served by decode from the transferred round
    convo += dc.tokens + [rng.randrange(5, 250) for _ in range(5)]
    _, pc, _, dc = pair.both(prompt=list(convo), max_tokens=6)
    pair.run_until(lambda: dc.ends)
    assert dc.tokens == mono(engines, convo, 6)
    assert pair.moved("d", "kv_transfers_completed") - before == 1
    assert dc.end.cached_tokens >= len(convo) - LIMIT
    pair.assert_clean("p", "d")


def test_an_aborted_local_round_gives_everything_back(pair, engines):
    rng = random.Random(13)
    convo = [rng.randrange(5, 250) for _ in range(33)]
    _, _, _, dc = pair.both(prompt=list(convo), max_tokens=6)
    pair.run_until(lambda: dc.ends)
    convo += dc.tokens + [rng.randrange(5, 250) for _ in range(4)]
    ps, pc, ds, dc = pair.both(prompt=list(convo), max_tokens=30)
    pair.run_until(lambda: len(dc.tokens) >= 3)
    engines[1].abort(ds.rid, reason="client left")
    pair.run_until(lambda: dc.ends and pc.ends)
    assert dc.end.finish_reason == "abort" and pc.end.error is None
    pair.assert_clean("p", "d")
    engines[1].prefix_cache.check()


def test_a_prompt_ending_on_a_boundary_is_kept_when_it_lands(pair, engines):
    """An answer too short to reach the next boundary: decode keeps the landed prompt (and, for
    V4, a snapshot of the row it landed with), so the next round still resumes there."""
    d = engines[1]
    b = d.prefix_cache.boundary
    rng = random.Random(14)
    convo = [rng.randrange(5, 250) for _ in range(4 * b)]
    _, _, _, dc = pair.both(prompt=list(convo), max_tokens=b // 2)
    pair.run_until(lambda: dc.ends)
    convo += dc.tokens + [rng.randrange(5, 250) for _ in range(3)]
    before = pair.moved("d", "kv_transfers_completed")
    _, _, _, dc = pair.both(prompt=list(convo), max_tokens=4)
    pair.run_until(lambda: dc.ends)
    assert pair.moved("d", "kv_transfers_completed") == before and dc.end.cached_tokens == 4 * b
    assert dc.tokens == mono(engines, convo, 4)
    pair.assert_clean("p", "d")


def test_a_repeated_prompt_or_a_new_conversation_over_a_held_prefix_goes_through_prefill(pair, engines):
    """Decode serves a round itself only when it continues a conversation decode served (its
    prompt starts with that request's prompt *and answer*). A prompt sent again, or a new
    conversation over a prefix decode holds (a shared system prompt), is prefill's: else decode
    would prefill every new conversation under a cached system prompt (PD undone)."""
    rng = random.Random(15)
    convo = [rng.randrange(5, 250) for _ in range(41)]
    _, _, _, dc = pair.both(prompt=list(convo), max_tokens=12)  # past a boundary: resumable inside it
    pair.run_until(lambda: dc.ends)
    answer = dc.tokens
    other = convo[:32] + [rng.randrange(5, 250) for _ in range(9)]  # held prefix, another conversation
    for prompt in (convo, other):
        before = pair.moved("d", "kv_transfers_completed")
        _, pc, _, dc = pair.both(prompt=list(prompt), max_tokens=12)
        pair.run_until(lambda: dc.ends and pc.ends)
        assert pair.moved("d", "kv_transfers_completed") - before == 1, prompt is convo
        assert dc.tokens == mono(engines, prompt, 12)
    local = pair.moved("d", "num_decode_local_reqs")
    nxt = convo + answer + [rng.randrange(5, 250) for _ in range(5)]  # the conversation's next round
    _, _, _, dc = pair.both(prompt=list(nxt), max_tokens=6)
    pair.run_until(lambda: dc.ends)
    assert pair.moved("d", "num_decode_local_reqs") == local + 1
    assert dc.tokens == mono(engines, nxt, 6)
    pair.assert_clean("p", "d")
    engines[1].prefix_cache.check()


@pytest.mark.slow
@pytest.mark.parametrize("preset,page", [("tiny", 8), ("v4-tiny", 8)])
def test_local_rounds_under_preemption_on_a_small_decode_pool_equal_mono(make_model, preset, page):
    """Decode's pool too small for three conversations at once: local rounds get preempted and
    recomputed (from decode's cache), cached pages are evicted for running work; every token still
    equals mono and everything comes back."""
    model = make_model(preset)
    extra = {"prefix_cache_snapshots": 6} if preset != "tiny" else {}

    def make(role: str, pages: int, cache: bool = True, local: int = 0) -> Engine:
        return Engine(
            EngineArgs(
                model=str(model),
                role=role,
                device="cpu",
                kernel_backend="cpu",
                kv_pages=pages,
                page_size=page,
                max_num_seqs=3,
                max_num_batched_tokens=48,
                served_model_name="m",
                enable_prefix_cache=cache,
                decode_local_prefill=local,
                **extra,
            )
        )

    engines = (make("prefill", 60), make("decode", 22, local=LIMIT), make("mono", 60, cache=False))
    pair = Pair(engines)
    preempted = []
    sched = engines[1].scheduler
    real = sched._preempt
    sched._preempt = lambda seq: (preempted.append(seq.rid), real(seq))[1]
    try:
        rng = random.Random(15)
        convos = [[rng.randrange(5, 250) for _ in range(30)] for _ in range(3)]
        for _ in range(3):
            started = [pair.both(prompt=list(c), max_tokens=12) for c in convos]
            pair.run_until(lambda: all(dc.ends for *_, dc in started), limit=120)
            for i, (_, pc, _, dc) in enumerate(started):
                assert dc.end.finish_reason == "length", dc.end.error
                assert dc.tokens == mono(engines, convos[i], 12)
                convos[i] = convos[i] + dc.tokens + [rng.randrange(5, 250) for _ in range(5)]
        assert pair.moved("d", "num_decode_local_reqs") > 0 and preempted
        pair.assert_clean("p", "d")
        engines[1].prefix_cache.check()
    finally:
        pair.close()


def test_prefill_computes_decodes_prompt_when_decode_spliced_answers(pair, engines):
    """Chat: decode rendered a re-sent answer as its generated ids, prefill (no memo) tokenized its
    text into other ids. A round prefill computes uses decode's ids (sent in the registration), so
    both sides hold one prompt and the tokens equal mono's on decode's ids."""
    rng = random.Random(16)
    spliced = [rng.randrange(5, 250) for _ in range(41)]
    plain = spliced[:20] + [7, 8, 9] + spliced[22:]  # one answer token came back as three
    ps, pc = pair.request("p", prompt=plain, max_tokens=6)
    ds, dc = pair.request("d", prompt=spliced, max_tokens=6, room=ps.pd.room)
    ds.plain_prompt_ids = plain  # as the HTTP process hands it over (before the engine takes it)
    pair.run_until(lambda: dc.ends)
    assert pc.end.error is None and dc.end.finish_reason == "length", dc.end.error
    assert dc.tokens == mono(engines, spliced, 6)
    assert ps.prompt_ids == spliced
    pair.assert_clean("p", "d")


def test_a_registration_carries_local_and_prompt_ids_and_refuses_bad_ones():
    from dsv4_engine.pd.messages import RegisterRoom

    msg = RegisterRoom(1, "r", {}, [], "http://d", "b", local=True, prompt_ids=[3, 4])
    back = RegisterRoom.of(msg.wire())
    assert back.local is True and back.prompt_ids == [3, 4]
    old = {k: v for k, v in msg.wire().items() if k not in ("local", "prompt_ids")}  # an older decode
    assert RegisterRoom.of(old).local is False and RegisterRoom.of(old).prompt_ids is None
    for bad in ([], [-1], ["3"], [True], "3 4"):
        with pytest.raises(ValueError, match="prompt_ids"):
            RegisterRoom.of({**msg.wire(), "prompt_ids": bad})


def test_prompt_ids_prefill_cannot_compute_fail_the_room_on_both_sides(pair, engines):
    ps, pc = pair.request("p", prompt=list(range(10, 40)), max_tokens=4)
    ds, dc = pair.request("d", prompt=list(range(10, 39)) + [10**6], max_tokens=4, room=ps.pd.room)
    ds.plain_prompt_ids = list(range(10, 40))
    pair.run_until(lambda: dc.ends and pc.ends)
    assert pc.end.error_code == 400 and "out of range" in pc.end.error
    assert dc.end.finish_reason in ("error", "abort") and "out of range" in dc.end.error
    pair.assert_clean("p", "d")
