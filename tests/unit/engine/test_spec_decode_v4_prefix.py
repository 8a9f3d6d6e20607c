"""DeepSeek-V4's prefix cache with MTP speculation on: multi-round conversations (a round's prompt
is the previous prompt, its answer and a new user turn) over v4-tiny (window 8, CSA every 4,
HCA every 8; page 4, so snapshots every 8 tokens), several at once, give the same greedy tokens
as an engine with neither (also under preemption, and for n > 1 choices sharing a prompt); later
rounds resume from the cache inside the previous answer; the drafter (the MTP block's ring, in
the same snapshots) drafts after a resume exactly what it drafts after computing the prefix
itself; every page, slot row and snapshot comes back."""

from __future__ import annotations

import random

import pytest
import torch

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.sequence import Sequence
from test_prefix_cache import drive
from test_spec_decode import _steer
from test_v4_prefix_cache import assert_everything_back, rows_only

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 400
BOUNDARY = 8  # page 4, HCA window 8
PREEMPTING = 30  # pages: the third round preempts (and resumes from the cache)


@pytest.fixture(scope="module")
def v4_mtp(tmp_path_factory):
    from dsv4_engine.checkpoint import init_checkpoint

    return init_checkpoint(tmp_path_factory.mktemp("v4mtp") / "v4-tiny-mtp", preset="v4-tiny", seed=0, mtp=True)


def engine_for(model, cache: bool, spec: bool, **kw) -> Engine:
    args = dict(
        model=str(model),
        device="cpu",
        kernel_backend="cpu",
        page_size=4,
        kv_pages=160,
        max_num_seqs=4,
        max_num_batched_tokens=24,
        enable_prefix_cache=cache,
        prefix_cache_snapshots=32,
        prefix_cache_snapshot_interval=16,
    )
    if spec:
        args.update(speculative_algorithm="mtp", speculative_num_steps=3)
    args.update(kw)
    return Engine(EngineArgs(**args))


def conversations(engine: Engine, rounds: int, seed: int, steer: dict | None = None):
    """Three conversations at once (one shares another's system prompt), `rounds` rounds each;
    returns {rid: tokens} and the admitted sequences. `steer`: {rid: tokens} of a reference run
    to steer the drafts by (right with the conversation's accuracy)."""
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB) for _ in range(17)]
    convos = [system + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (6, 11)]
    convos.append([rng.randrange(3, VOCAB) for _ in range(21)])
    accuracy = [1.0, 0.5, 0.2]
    outs: dict = {}
    seqs: list[Sequence] = []
    if steer is not None:
        _steer(engine, steer, {f"c{c}r{rnd}": accuracy[c] for c in range(3) for rnd in range(rounds)})
    for rnd in range(rounds):
        arrivals = {2 * c: [(f"c{c}r{rnd}", list(p), 9 + 2 * c + rnd)] for c, p in enumerate(convos)}
        got, s = drive(engine, arrivals, {})
        assert all(reason == "length" for _, reason in got.values()), got
        outs.update({rid: (toks, reason) for rid, (toks, reason) in got.items()})
        seqs += s
        for c in range(3):
            convos[c] = (
                convos[c] + got[f"c{c}r{rnd}"][0] + [rng.randrange(3, VOCAB) for _ in range(rng.choice([3, 7, 8]))]
            )
    return outs, seqs


@pytest.fixture(scope="module")
def plain(v4_mtp):
    """The conversations on an engine with neither speculation nor cache."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return conversations(engine_for(v4_mtp, False, False), 3, seed=1)[0]
    finally:
        torch.set_num_threads(n)


@pytest.mark.parametrize(
    "in_forward,pages",
    [
        pytest.param(True, 160, id="in-forward"),
        pytest.param(False, 160, id="rows-only", marks=pytest.mark.slow),
        pytest.param(True, PREEMPTING, id="preempting"),
    ],
)
def test_multi_round_conversations_with_speculation_and_the_cache_equal_neither(v4_mtp, plain, in_forward, pages):
    ref = plain
    engine = engine_for(v4_mtp, True, True, kv_pages=pages)
    if not in_forward:
        rows_only(engine)  # the kernel path's way: chunks end at boundaries, rows copied after steps
    preempted = []
    preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: (preempted.append(seq.rid), preempt(seq))
    assert engine.loads()["prefix_cache"]["enabled"] is True
    got, seqs = conversations(engine, 3, seed=1, steer=ref)
    assert got == ref
    t = engine.metrics.totals
    assert 0 < t["spec_decode_num_accepted_tokens"] < t["spec_decode_num_draft_tokens"]
    stats = engine.prefix_cache.stats()
    assert stats["snapshots_restored"] >= 6, stats
    hit = {s.rid: s.num_cached_tokens for s in seqs}
    for s in seqs:
        assert hit[s.rid] % BOUNDARY == 0
        if not s.rid.endswith("r0") and pages != PREEMPTING:  # (a small pool evicts what it needs)
            # it resumes inside the previous answer, at the latest boundary that round reached
            # before its last step (at most k + 1 = 4 tokens): drafts never jump over a
            # boundary, so every one is reached and snapshotted
            c, rnd = s.rid[1], int(s.rid[-1])
            prev = next(p for p in seqs if p.rid == f"c{c}r{rnd - 1}")
            want = (prev.num_tokens - 1 - 4) // BOUNDARY * BOUNDARY
            assert want > len(prev.prompt_ids) and hit[s.rid] >= want, (s.rid, hit[s.rid], prev.num_tokens)
    assert hit["c1r0"] == 16  # the second conversation resumes in the first one's system prompt
    assert bool(preempted) == (pages == PREEMPTING), preempted
    assert_everything_back(engine)


@pytest.mark.parametrize(
    "where,resume",
    [
        pytest.param("answer", 40, id="decode-snapshot"),  # copied from the row after a verify step
        pytest.param("prompt", 32, id="in-forward-snapshot"),  # written inside a prefill chunk
    ],
)
def test_drafts_after_a_resume_equal_drafts_after_computing_the_prefix(v4_mtp, where, resume):
    """The MTP block's own ring travels in the snapshots: a request resumed from the cache drafts
    (real drafter, greedy) the same tokens at every step as one that computed its prefix, from
    the same logits. With the block's part of the snapshot zeroed, they differ (the check has
    teeth)."""
    rng = random.Random(3)
    first = [rng.randrange(3, VOCAB) for _ in range(37)]  # prefilled in chunks of 24: 32 is inside one
    turn = [rng.randrange(3, VOCAB) for _ in range(3)]

    def drafts(engine: Engine) -> tuple[list, int]:
        warm, _ = drive(engine, {0: [("warm", first, 6)]}, {})
        # it resumes at the warm answer's boundary 40 (of 46 tokens) or at the prompt's 32 (of 38),
        # less than a window (8) before its last token: the block reads the restored ring
        second = first + warm["warm"][0] + turn if where == "answer" else first[:35] + turn
        seen: list[tuple[list[int], torch.Tensor]] = []
        draft = engine.spec._draft

        def record(batch, chain, dlogits, *a):
            draft(batch, chain, dlogits, *a)
            seen.extend((engine.spec.drafts[batch[i].seq].tokens, dlogits[j]) for i, j, _, _ in chain)

        engine.spec._draft = record
        _, seqs = drive(engine, {0: [("b", second, 14)]}, {})
        engine.spec._draft = draft
        return seen, seqs[0].num_cached_tokens

    plain = engine_for(v4_mtp, False, True)
    plain.spec.cache_boundary = BOUNDARY  # the same drafts per step as with the cache (they stop at boundaries)
    want, hit = drafts(plain)
    assert hit == 0 and len(want) >= 5
    engine = engine_for(v4_mtp, True, True)
    got, hit = drafts(engine)
    assert hit == resume and [t for t, _ in got] == [t for t, _ in want]
    # the catch-up's logits (the first draft's distribution) at every step, to fp32 rounding
    # (the prefix was computed in other chunks)
    for (_, a), (_, b) in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert_everything_back(engine)

    blind = engine_for(v4_mtp, True, True)
    restore = blind.prefix_cache.snapshots.restore

    def restore_without_mtp(snap, row):
        restore(snap, row)
        blind.pool.slot_states["mtp_swa_kv"][row].zero_()

    blind.prefix_cache.snapshots.restore = restore_without_mtp
    other, hit = drafts(blind)
    assert hit == resume
    assert max((a - b).abs().max().item() for (_, a), (_, b) in zip(other, want)) > 1e-2


def test_choices_sharing_a_prompt_resume_from_the_first_ones_snapshot(v4_mtp):
    """n > 1 with speculation: the other choices wait for the first one's prompt and resume at
    its last boundary (pages, rings and the MTP block's ring from the snapshot); every greedy
    choice equals plain decoding."""
    from dsv4_engine.sampling_params import SamplingParams

    prompt = list(range(7, 45))  # 38 tokens: resumes at 32
    want, _ = drive(engine_for(v4_mtp, False, False), {0: [("c0", prompt, 12)]}, {})
    engine = engine_for(v4_mtp, True, True)
    outs: dict = {}
    seqs = []
    for i in range(3):
        seq = Sequence(
            f"c{i}",
            prompt,
            SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
            sink=lambda o, i=i: outs.setdefault(i, []).extend(o.token_ids),
        )
        seq.share_prefix_of = "c0" if i else None
        seqs.append(seq)
        engine.submit(seq)
    for _ in range(500):
        if all(s.finished for s in seqs):
            break
        engine.step()
    assert [outs[i] for i in range(3)] == [want["c0"][0]] * 3
    assert [s.num_cached_tokens for s in seqs] == [0, 32, 32]
    assert_everything_back(engine)
