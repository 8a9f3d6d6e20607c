"""`--tp-size 2` (rank 0 here, rank 1 a real child process, gloo on 127.0.0.1) produces the same
greedy tokens as `--tp-size 1` in fp32: staggered arrivals, chunked prefill and preemption.
Each rank holds only its slice of the weights (measured from the tensors it keeps)."""

from __future__ import annotations

import random

import pytest
import torch

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.layers.moe import DeepseekMoE
from dsv4_engine.model_runner import ModelRunner
from dsv4_engine.parallel.group import TPRank
from dsv4_engine.parallel.plan import Shard
from dsv4_engine.parallel.sharded import resident_weight_bytes
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence

NEW_TOKENS = 8


@pytest.fixture(autouse=True)
def one_thread():
    """Rank 0 computes on one thread, as TPGroup sets it for the shared cores: the tp-1 reference
    engines too (on a busy machine, two threads contending over tiny matmuls were several times slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def prompts(vocab: int, lens: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]


def drive(engine: Engine, arrivals: dict[int, list[tuple[str, list[int]]]]) -> tuple[dict[str, list[int]], list]:
    """Step the engine by hand (no thread); requests join at the steps given."""
    outs: dict[str, list[int]] = {}
    done: set[str] = set()

    def sink_for(rid):
        def sink(out):
            outs.setdefault(rid, []).extend(out.token_ids)
            if out.finished:
                assert out.finish_reason == "length", (rid, out)
                done.add(rid)

        return sink

    total = sum(len(v) for v in arrivals.values())
    seqs, step = [], 0
    while len(done) < total:
        for rid, prompt in arrivals.get(step, []):
            seqs.append(
                Sequence(
                    rid,
                    prompt,
                    SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True),
                    sink=sink_for(rid),
                )
            )
            engine.submit(seqs[-1])
        engine.step()
        step += 1
        assert step < 3000, "engine made no progress"
    assert engine.pool.allocator.num_free == engine.pool.num_pages
    return outs, seqs


def scenarios(engine: Engine) -> dict:
    """Staggered arrivals; then chunked prefill (16-token steps) with preemption (10 pages of 8
    tokens cannot hold three requests of 30+ tokens each)."""
    v = engine.cfg.vocab_size
    ps = prompts(v, [5, 30, 17, 9], seed=1)
    staggered, _ = drive(engine, {0: [("s0", ps[0])], 3: [("s1", ps[1]), ("s2", ps[2])], 7: [("s3", ps[3])]})
    ps = prompts(v, [40, 36, 24], seed=2)
    chunked, seqs = drive(engine, {0: [("a", ps[0]), ("b", ps[1])], 2: [("c", ps[2])]})
    # Prefix cache: the second request reuses the first one's cached pages, which every rank
    # holds alike because every rank wrote them in the same steps (V4: and the snapshot of the
    # slot row at their boundary, which every rank copies).
    base = prompts(v, [26], seed=3)[0]
    hits = engine.metrics.totals.get("prefix_cache_hit_tokens", 0)
    prefixed = {**drive(engine, {0: [("p0", base + [7, 8])]})[0], **drive(engine, {0: [("p1", base + [9])]})[0]}
    return {
        "staggered": staggered,
        "chunked": chunked,
        "preemptions": sum(s.num_preemptions for s in seqs),
        "prefixed": prefixed,
        "hit_tokens": engine.metrics.totals.get("prefix_cache_hit_tokens", 0) - hits,
    }


def engine(model_dir, tp_size: int) -> Engine:
    return Engine(
        EngineArgs(
            model=str(model_dir),
            device="cpu",
            kernel_backend="cpu",
            kv_pages=10,
            page_size=8,
            max_num_batched_tokens=16,
            tp_size=tp_size,
        )
    )


@pytest.mark.parametrize("preset", ["tiny", "mla512", "v4-tiny"])
def test_tp2_greedy_tokens_equal_tp1(make_model, preset):
    model = make_model(preset)
    ref = scenarios(engine(model, 1))
    e = engine(model, 2)
    try:
        assert e.loads()["tp_size"] == 2
        got = scenarios(e)
    finally:
        e.tp.close()
    assert ref["preemptions"] > 0 and got["preemptions"] > 0, "the small pool should have forced a preemption"
    assert got["staggered"] == ref["staggered"] and len(got["staggered"]) == 4
    assert got["chunked"] == ref["chunked"]
    assert got["prefixed"] == ref["prefixed"]
    assert e.prefix_cache is not None  # V4 too: its snapshots are copied on every rank
    assert got["hit_tokens"] > 0, "the second request should have reused the first one's pages"
    assert all(p.poll() == 0 for p in e.tp.procs), "the other rank stops cleanly when told"


def test_each_rank_holds_half_the_experts_and_split_layers_plus_the_replicated_rest(make_model):
    model = make_model("tiny")
    full = ModelRunner(str(model), device="cpu", kernel_backend="cpu").model
    ranks = [
        ModelRunner(str(model), device="cpu", kernel_backend="cpu", tp=TPRank(Shard(r, 2), None, None)).model
        for r in range(2)
    ]
    cfg = full.cfg
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]

    def parts(L) -> dict:
        """The layer's weights by what they are (typed layers: dsv4_engine.layers)."""
        a, m = L.attn, L.mlp
        out = {"q_b": a.q_b.weight, "w_uk": a.w_uk, "w_uv": a.w_uv, "o": a.o.weight, **a.absorb}
        if isinstance(m, DeepseekMoE):
            out |= {"w13": m.w13, "w2": m.w2, "gate": m.router.gate}
            if m.shared is not None:
                out |= {"s_w13": m.shared[0], "s_w2": m.shared[1]}
        else:
            out |= {"d_w13": m.w13, "d_w2": m.w2}
        return out

    def nbytes(model, keys) -> int:
        return sum(t.numel() * t.element_size() for L in model.layers for k, t in parts(L).items() if k in keys)

    experts = ("w13", "w2")
    split = ("q_b", "w_uk", "w_uk_packed", "w_uv", "w_uvt", "o", "d_w13", "d_w2", "s_w13", "s_w2")
    # Experts: each rank holds exactly its half, and together they hold every expert once.
    assert [r.cfg.n_routed_experts for r in ranks] == [cfg.n_routed_experts // 2] * 2
    assert sum(nbytes(r, experts) for r in ranks) == nbytes(full, experts) > 0
    for r in ranks:
        assert nbytes(r, experts) * 2 == nbytes(full, experts)
        assert nbytes(r, split) * 2 == nbytes(full, split)
        replicated = resident_weight_bytes(full) - nbytes(full, experts) - nbytes(full, split)
        assert resident_weight_bytes(r) == replicated + nbytes(full, experts) // 2 + nbytes(full, split) // 2
        pairs = [(parts(a), parts(b)) for a, b in zip(r.layers, full.layers)]
        assert all(torch.equal(a["gate"], b["gate"]) for a, b in pairs if "gate" in a)
    assert moe


def test_v4_ranks_split_the_routed_experts_and_replicate_the_rest(make_model):
    model = make_model("v4-tiny")
    full = ModelRunner(str(model), device="cpu", kernel_backend="cpu").model
    ranks = [
        ModelRunner(str(model), device="cpu", kernel_backend="cpu", tp=TPRank(Shard(r, 2), None, None)).model
        for r in range(2)
    ]

    def nbytes(model, keys) -> int:
        return sum(
            getattr(L["moe"], k).numel() * getattr(L["moe"], k).element_size() for L in model.layers for k in keys
        )

    experts = ("w13", "w2")
    for r in ranks:
        assert nbytes(r, experts) * 2 == nbytes(full, experts) > 0
        replicated = resident_weight_bytes(full) - nbytes(full, experts)
        assert resident_weight_bytes(r) == replicated + nbytes(full, experts) // 2
    # Rank 1's experts are the full model's second half, under local ids.
    E = full.cfg.n_routed_experts
    assert torch.equal(ranks[1].layers[0]["moe"].w13, full.layers[0]["moe"].w13[E // 2 :])


@pytest.mark.parametrize("preset,quant", [("mla512", "fp8"), ("v4-tiny", "fp4-experts")])
def test_quantized_checkpoints_split_with_their_scales(tmp_path, preset, quant):
    """fp8 block scales are sliced with their weights (V3 heads and MLP), fp4 experts go whole
    to their owner (V4): tp 2 generates what tp 1 does."""
    from dsv4_engine.checkpoint import init_checkpoint

    model = init_checkpoint(tmp_path / preset, preset=preset, quant=quant)
    v = 512
    ps = prompts(v, [5, 23, 11], seed=4)
    arrivals = {0: [("q0", ps[0]), ("q1", ps[1])], 2: [("q2", ps[2])]}
    ref, _ = drive(engine(model, 1), arrivals)
    e = engine(model, 2)
    try:
        got, _ = drive(e, arrivals)
    finally:
        e.tp.close()
    assert got == ref and len(got) == 3


@pytest.mark.slow  # 7 s quiet, 30-40 s loaded; test_tp2_greedy_tokens_equal_tp1[v4-tiny] covers the copies by default
def test_v4_prefix_reuse_at_tp2_equals_tp1_without_a_cache(make_model):
    """V4's prefix cache over two ranks: rank 0 keeps the books and every snapshot copy (save
    after a step, restore at admission) is repeated on rank 1, whose replicated attention reads
    its own slot rows. A shared prefix, a growing conversation resuming inside its answer, and
    a pool small enough to preempt: the tokens equal tp 1 without a cache, snapshots were
    restored, and every page, slot row and snapshot is back at the end."""
    model = make_model("v4-tiny")
    v = 512
    system = prompts(v, [27], seed=5)[0]
    a, b, c = prompts(v, [6, 11, 4], seed=6)

    def run(e: Engine) -> dict:
        first, _ = drive(e, {0: [("a", system + a)], 1: [("b", system + b)]})
        # Round 2 re-sends round 1's prompt and answer (a decode snapshot lies inside it).
        grown = system + a + first["a"] + c
        second, _ = drive(e, {0: [("a2", grown)], 2: [("c", system + c)]})
        return {**first, **second}

    ref = run(
        Engine(
            EngineArgs(
                model=str(model),
                device="cpu",
                kernel_backend="cpu",
                kv_pages=12,
                page_size=8,
                max_num_batched_tokens=16,
                enable_prefix_cache=False,
            )
        )
    )
    e = Engine(
        EngineArgs(
            model=str(model),
            device="cpu",
            kernel_backend="cpu",
            kv_pages=12,
            page_size=8,
            max_num_batched_tokens=16,
            tp_size=2,
            prefix_cache_snapshots=6,
        )
    )
    try:
        got = run(e)
        snaps = e.prefix_cache.snapshots
        assert got == ref and len(got) == 4
        assert snaps.restored >= 3, "b, a2 and c should each have resumed from a snapshot"
        assert e.metrics.totals["prefix_cache_hit_tokens"] >= 3 * 24
        assert snaps.num_reserved == 0 and e.pool.slots.num_free == e.pool.slots.total
        assert not any(e.pool.allocator.refcount(p) for p in range(e.pool.num_pages))
        assert e.loads()["prefix_cache"]["snapshots_in_forward"] is False  # chunks end at boundaries instead
        assert e.tp.failed is None
    finally:
        e.tp.close()
