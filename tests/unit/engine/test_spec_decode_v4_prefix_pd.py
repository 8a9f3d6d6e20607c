"""DeepSeek-V4 PD with speculation on both sides and prefill's prefix cache (v4-tiny over the fake
fabric): multi-round conversations, several at once, equal a monolithic engine with neither
speculation nor cache; prefill resumes each later round from its snapshots (hit counts), and the
MTP block's ring it restores with them travels to decode, which drafts exactly what a monolithic
speculating engine that computed the whole prompt drafts; every page, slot row and snapshot
comes back on both sides."""

from __future__ import annotations

import itertools
import random

import pytest

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.pd.request_info import PDRequestInfo
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence
from test_spec_decode_pd import all_back, models, pair, record_drafts, run  # noqa: F401 (fixture)
from test_v4_prefix_cache import assert_everything_back

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 400
ROOMS = itertools.count(1)


def mono_engine(model, spec: bool) -> Engine:
    extra = dict(speculative_algorithm="mtp", speculative_num_steps=3) if spec else {}
    return Engine(
        EngineArgs(
            model=str(model),
            device="cpu",
            kernel_backend="cpu",
            kv_pages=64,
            page_size=8,
            max_num_seqs=8,
            enable_prefix_cache=False,
            **extra,
        )
    )


def through(engines: tuple, reqs: dict) -> tuple[dict, dict]:
    """rid -> prompt, all at once, greedy: rid -> tokens, and rid -> the prefill side's request
    (PD), or the monolithic engine's."""
    got: dict = {}
    seqs: dict = {}
    pd = len(engines) == 2
    for rid, (prompt, n) in reqs.items():
        room = next(ROOMS)
        for side, eng in (("p", engines[0]), ("d", engines[1])) if pd else (("m", engines[0]),):

            def sink(o, side=side, rid=rid):
                if side != "p":
                    got.setdefault(rid, []).extend(o.token_ids)

            s = Sequence(f"{side}-{rid}", list(prompt), SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            s.sink = sink
            if pd:
                s.pd = PDRequestInfo("127.0.0.1", 9100, room)
                s.prefill_only = side == "p"
            seqs[(side, rid)] = s
            eng.submit(s)
    run(list(engines), lambda: all(s.finished for s in seqs.values()))
    return got, {rid: seqs[("p" if pd else "m", rid)] for rid in reqs}


def conversations(engines: tuple, rounds: int = 3) -> tuple[dict, dict]:
    rng = random.Random(2)
    system = [rng.randrange(3, VOCAB) for _ in range(19)]
    convos = [system + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 12)]
    convos.append([rng.randrange(3, VOCAB) for _ in range(26)])
    outs, hits = {}, {}
    for rnd in range(rounds):
        got, seqs = through(engines, {f"c{c}r{rnd}": (p, 8 + 3 * c) for c, p in enumerate(convos)})
        outs.update(got)
        hits.update({rid: (s.num_cached_tokens, len(s.prompt_ids)) for rid, s in seqs.items()})
        for c in range(3):
            convos[c] = convos[c] + got[f"c{c}r{rnd}"] + [rng.randrange(3, VOCAB) for _ in range(4 + c)]
    return outs, hits


def test_multi_round_conversations_through_pd_with_speculation_and_the_cache(models):
    model = models["v4"]
    want, _ = conversations((mono_engine(model, False),))
    p, d = pair(model, True, True)
    assert p.prefix_cache is not None and p.prefix_cache.snapshots is not None
    got, hits = conversations((p, d))
    assert got == want
    # page 8: boundary 8; a later round resumes at the last boundary of its previous prompt (prefill
    # never sees decode's answer)
    for rid, (h, _) in hits.items():
        rnd = int(rid[-1])
        prev = hits[f"{rid[:-1]}{rnd - 1}"][1] if rnd else 1
        assert h == prev // 8 * 8 and (rnd == 0 or h >= 24), hits
    assert p.prefix_cache.stats()["snapshots_restored"] == 6
    assert d.metrics.totals["spec_decode_num_draft_tokens"] > 0
    all_back(p, d)
    assert_everything_back(p)


def mtp_ring_at_first_token(engine: Engine) -> dict:
    """rid -> the MTP block's ring in the request's slot row when its first token is out (after
    the prompt's step: on a prefill engine, what goes to decode)."""
    rings: dict = {}
    append = engine._append_token

    def first(seq, tok, logprob=None):
        if not seq.output_ids:
            rings[seq.rid.split("-")[1]] = engine.pool.slot_states["mtp_swa_kv"][seq.slot].clone()
        append(seq, tok, logprob)

    engine._append_token = first
    return rings


@pytest.mark.parametrize("zeroed", [False, True], ids=["restored", "ring-zeroed"])
def test_decode_drafts_after_prefill_resumed_from_the_cache(models, zeroed):
    """Prefill resumes the second prompt at 32 with 6 tokens left, less than the window of 8: the
    MTP block's ring it sends to decode holds two restored positions. It equals the ring of a
    monolithic speculating engine that computed the whole prompt, and decode drafts what that
    engine drafts. With the restored part zeroed, the rings differ (the check has teeth)."""
    import torch

    model = models["v4"]
    rng = random.Random(4)
    first = [rng.randrange(3, VOCAB) for _ in range(37)]
    second = first[:35] + [rng.randrange(3, VOCAB) for _ in range(3)]
    m = mono_engine(model, True)
    drafts_mono, ring_mono = record_drafts(m, lambda rid: rid.split("-")[1]), mtp_ring_at_first_token(m)
    through((m,), {"b": (second, 16)})
    p, d = pair(model, True, True)
    drafts_pd, ring_pd = record_drafts(d, lambda rid: rid.split("-")[1]), mtp_ring_at_first_token(p)
    through((p, d), {"a": (first, 4)})
    if zeroed:
        restore = p.prefix_cache.snapshots.restore

        def restore_zeroed(snap, row):
            restore(snap, row)
            p.pool.slot_states["mtp_swa_kv"][row].zero_()

        p.prefix_cache.snapshots.restore = restore_zeroed
    _, seqs = through((p, d), {"b": (second, 16)})
    assert seqs["b"].num_cached_tokens == 32
    if zeroed:
        assert (ring_pd["b"] - ring_mono["b"]).abs().max() > 1e-2
        return
    torch.testing.assert_close(ring_pd["b"], ring_mono["b"], rtol=1e-4, atol=1e-4)
    common = {k for k in set(drafts_pd) & set(drafts_mono) if k[0] == "b"}
    assert len(common) >= 4 and all(drafts_pd[k] == drafts_mono[k] for k in common)
    all_back(p, d)
