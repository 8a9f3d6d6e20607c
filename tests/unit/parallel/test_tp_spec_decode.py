"""Speculative decoding at `--tp-size 2` (rank 0 here, rank 1 a real child process, gloo on
127.0.0.1): greedy tokens equal `--tp-size 1` without speculation, V3 and V4, for concurrent
requests arriving at different steps, drafts steered to be right, wrong or half right per request
(so verify accepts some and V4's rings are rolled back on both ranks), and an abort mid-way. The
MTP block's own drafts (before steering) equal those of a one-rank speculating engine: rank 1's
half of the block (its heads / experts, its MTP state) computed its share right. Every page and
slot row is back in rank 0's books (rank 1 keeps none: its pool mirrors rank 0's)."""

from __future__ import annotations

import random

import pytest
import torch

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only contend on these shared cores
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory):
    from dsv4_engine.checkpoint import init_checkpoint

    d = tmp_path_factory.mktemp("tp-mtp")
    return lambda preset: init_checkpoint(d / preset, preset=preset, seed=0, mtp=True)


def make_engine(model, tp_size: int, spec: bool) -> Engine:
    # Without V4's prefix cache: it snapshots inside chunks at tp 1 and after steps at tp 2, so
    # the schedules (and with them the steered drafts compared below) would part.
    args = dict(
        model=str(model),
        device="cpu",
        kernel_backend="cpu",
        kv_pages=24,
        page_size=8,
        max_num_batched_tokens=24,
        enable_prefix_cache=False,
    )
    if spec:
        args.update(speculative_algorithm="mtp", speculative_num_steps=3)
    return Engine(EngineArgs(**args, tp_size=tp_size))


def requests(seed: int) -> dict[str, tuple[int, list[int], SamplingParams]]:
    """rid -> (arrival step, prompt, params): prompts around v4-tiny's window (8) and compressor
    boundaries (4, 8), answers that cross several more."""
    rng = random.Random(seed)
    out = {}
    for i, n in enumerate([3, 8, 9, 17, 23]):
        params = SamplingParams(max_tokens=rng.randint(10, 16), temperature=0, ignore_eos=True)
        out[f"r{i}"] = (0 if i < 3 else 2 + i, [rng.randrange(3, 500) for _ in range(n)], params)
    return out


ACCURACY = {"r0": 1.0, "r1": 0.0, "r2": 0.5, "r3": 0.7, "r4": 0.3}
ABORT = ("r2", 6)  # r2 is aborted at step 6, drafts in flight


def drive(engine: Engine, reqs: dict, reference: dict = None) -> tuple[dict, dict]:
    """Step the engine by hand. With a reference (plain outputs), ABORT happens, and each
    request's drafts are steered: right with its ACCURACY, else wrong; the drafter's own drafts are recorded first.
    Returns ({rid: (tokens, finish reason)}, {(rid, tokens so far): the drafter's drafts})."""
    outs: dict[str, list] = {}
    drafted: dict = {}
    if reference is not None:
        spec, rng, original = engine.spec, random.Random(0), engine.spec.lookahead

        def lookahead(seq):
            n = original(seq)
            if n:
                d = spec.drafts[seq]
                drafted.setdefault((seq.rid, len(seq.output_ids)), list(d.tokens[:n]))
                want = reference[seq.rid][0][len(seq.output_ids) :]
                for j in range(n):
                    right = want[j] if j < len(want) else 7
                    d.tokens[j] = right if rng.random() < ACCURACY[seq.rid] else (right + 1) % 500
            return n

        spec.lookahead = engine.scheduler.lookahead = lookahead

    def sink(out):
        toks, _ = outs.get(out.rid, ([], None))
        outs[out.rid] = (toks + list(out.token_ids), out.finish_reason)

    step = 0
    while sum(v[1] is not None for v in outs.values()) < len(reqs):
        for rid, (at, prompt, params) in reqs.items():
            if at == step:
                engine.submit(Sequence(rid, prompt, params, sink=sink))
        if reference is not None and step == ABORT[1]:
            engine.abort(ABORT[0])
        engine.step()
        step += 1
        assert step < 2000, "engine made no progress"
    assert engine.pool.allocator.num_free == engine.pool.allocator.total, "pages not returned"
    slots = engine.pool.slots  # V4's slot rows (V3 has none)
    assert slots is None or slots.num_free == slots.total, "slot rows not returned"
    assert not engine.seqs and not engine.scheduler.running
    return outs, drafted


@pytest.mark.parametrize("preset", ["tiny", "v4-tiny"])
def test_tp2_speculation_equals_tp1_plain_decoding(mtp_models, preset):
    torch.manual_seed(0)
    model = mtp_models(preset)
    reqs = requests(1)
    plain, _ = drive(make_engine(model, 1, False), reqs)  # no abort: every full answer
    ref, ref_drafts = drive(make_engine(model, 1, True), reqs, plain)
    e = make_engine(model, 2, True)
    try:
        got, got_drafts = drive(e, reqs, plain)
        assert e.tp.failed is None
        t = e.metrics.totals
        assert 0 < t["spec_decode_num_accepted_tokens"] < t["spec_decode_num_draft_tokens"]
    finally:
        e.tp.close()
    assert all(p.poll() == 0 for p in e.tp.procs), "rank 1 stops cleanly when told"
    toks, reason = got.pop(ABORT[0])
    assert reason == "abort" and 0 < len(toks) < len(plain[ABORT[0]][0]) and toks == plain[ABORT[0]][0][: len(toks)]
    assert got == {rid: (v[0], "length") for rid, v in plain.items() if rid != ABORT[0]}
    assert got_drafts == ref_drafts and len(got_drafts) > 10
    assert ref.pop(ABORT[0])[0] == toks and ref == got


@pytest.mark.parametrize("preset", ["tiny", "v4-tiny"])
def test_each_rank_holds_its_share_of_the_mtp_block(mtp_models, preset):
    """The MTP block is split like a target layer: V3's heads, shared experts and routed experts,
    V4's query heads, output groups and routed experts; the two ranks' routed experts are the
    one-rank block's, under local ids."""
    from dsv4_engine.model_runner import ModelRunner
    from dsv4_engine.parallel.group import TPRank
    from dsv4_engine.parallel.plan import Shard
    from dsv4_engine.spec_decode.build import make_speculator

    model = mtp_models(preset)

    def block(tp):
        runner = ModelRunner(str(model), device="cpu", kernel_backend="cpu", tp=tp)
        return make_speculator(runner, str(model), 2).mtp.L

    full = block(None)
    ranks = [block(TPRank(Shard(r, 2), None, None)) for r in range(2)]

    def parts(L) -> dict:
        """The block's weights by what they are: V3's typed decoder layer, V4's typed layer."""
        if hasattr(L, "ffn"):
            m = L.ffn
            named = {k: getattr(L.attn, k) for k in ("wkv", "wq_b", "wo_a", "wo_b", "sink")}
            return {
                **named,
                "w13": m.w13,
                "w2": m.w2,
                "gate": m.router.gate,
                "bias": m.router.bias,
                "s_w13": m.shared[0],
            }
        a, m = L.attn, L.mlp
        return {
            "q_b": a.q_b.weight, "w_uk": a.w_uk, "w_uv": a.w_uv, "o": a.o.weight, "kv_a": a.kv_a.weight, **a.absorb,
            "w13": m.w13, "w2": m.w2, "gate": m.router.gate, "bias": m.router.bias,
            "s_w13": m.shared[0], "s_w2": m.shared[1],
        }  # fmt: skip

    full = parts(full)
    E = full["w13"].shape[0]
    for r, L in enumerate(parts(L) for L in ranks):
        assert torch.equal(L["w13"], full["w13"][r * E // 2 : (r + 1) * E // 2])
        assert torch.equal(L["w2"], full["w2"][r * E // 2 : (r + 1) * E // 2])
        split = ("q_b", "w_uk", "w_uv", "w_uvt", "o", "s_w13", "s_w2") if preset == "tiny" else ()
        split += ("wq_b", "wo_a", "wo_b", "sink") if preset == "v4-tiny" else ()
        for k in split:
            assert L[k].numel() * 2 == full[k].numel(), k
        for k in ("gate", "bias") + (("wkv", "s_w13") if preset == "v4-tiny" else ("kv_a",)):
            assert torch.equal(L[k], full[k]), k
