"""Speculative decoding on DeepSeek-V4 (its `mtp.0.*` block): greedy output equals plain
decoding token for token, with the real drafter and with drafts steered to be right, wrong or half
right per request, for prompts that end around the window and compression boundaries, under
concurrency and preemption, with every page and slot row back; the window ring and compressor
stages of rejected positions are put back (without that, outputs differ: checked); the block
loads from the release and transformers layouts; what is not built is refused."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from dsv4_engine.sampling_params import SamplingParams
from test_spec_decode import _engine, _requests, _run, _steer


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def v4_mtp(tmp_path_factory):
    from dsv4_engine.checkpoint import init_checkpoint

    return init_checkpoint(tmp_path_factory.mktemp("v4mtp") / "v4-tiny-mtp", preset="v4-tiny", seed=0, mtp=True)


def _boundary_requests(seed: int = 0) -> list:
    """v4-tiny: window 8, CSA every 4 tokens (stage ring 8), HCA every 8: prompts that end just
    before, on and after those boundaries, and answers that cross several more."""
    rng = random.Random(seed)
    lens = [3, 7, 8, 9, 15, 16, 17, 23]
    return [
        (
            [rng.randrange(2, 500) for _ in range(n)],
            SamplingParams(max_tokens=rng.randint(10, 20), temperature=0, ignore_eos=True),
        )
        for n in lens
    ]


def _slots_back(engine) -> None:
    assert engine.pool.slots.num_free == engine.pool.slots.total, "slot rows not returned"


def test_v4_greedy_with_the_real_drafter_equals_plain_decoding(v4_mtp):
    reqs = _boundary_requests(0)
    plain = _run(_engine(v4_mtp, False), reqs)
    engine = _engine(v4_mtp, True, steps=3)
    assert _run(engine, reqs) == plain
    _slots_back(engine)
    assert engine.metrics.totals["spec_decode_num_draft_tokens"] > 0
    assert engine.loads()["prefix_cache"]["enabled"] is True  # with speculation too (test_spec_decode_v4_prefix)


def test_v4_rejected_drafts_roll_back_rings_under_concurrency_and_preemption(v4_mtp):
    reqs = _boundary_requests(1)
    plain = _run(_engine(v4_mtp, False, kv_pages=12), reqs)
    accuracy = {f"r{i}": a for i, a in enumerate([1.0, 0.0, 0.5, 0.8, 0.3, 0.6, 1.0, 0.2])}
    engine = _engine(v4_mtp, True, steps=3, kv_pages=12)
    _steer(engine, plain, accuracy)
    preempted = []
    preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: (preempted.append(seq.rid), preempt(seq))
    assert _run(engine, reqs) == plain
    _slots_back(engine)
    assert preempted, "the pool was meant to be small enough to preempt"
    t = engine.metrics.totals
    assert 0 < t["spec_decode_num_accepted_tokens"] < t["spec_decode_num_draft_tokens"]


def test_v4_chunked_prefill_with_a_small_step_budget(v4_mtp):
    """5 tokens a step: prompts are cut at every offset of the windows, prefill chunks share
    steps with verify rows (a decode row of 1 + 3 drafts takes 4 of the 5)."""
    reqs = _boundary_requests(4)[::2]
    plain = _run(_engine(v4_mtp, False), reqs)
    engine = _engine(v4_mtp, True, steps=3, max_num_batched_tokens=5)
    _steer(engine, plain, {"r0": 1.0, "r1": 0.5, "r2": 0.0, "r3": 0.7})
    assert _run(engine, reqs) == plain
    _slots_back(engine)


def test_v4_without_the_ring_rollback_outputs_differ(v4_mtp, monkeypatch):
    """The check above has teeth: rejected drafts left in the window ring and compressor stages
    change later tokens."""
    from dsv4_engine.spec_decode import mtp_v4

    reqs = _boundary_requests(1)[:4]
    plain = _run(_engine(v4_mtp, False), reqs)
    original = mtp_v4.RingRollback.restore
    monkeypatch.setattr(
        mtp_v4.RingRollback,
        "restore",
        lambda self, keep_below=None: original(self, keep_below) if keep_below is None else None,
    )
    engine = _engine(v4_mtp, True, steps=3)
    _steer(engine, plain, {"r0": 0.5, "r1": 0.0, "r2": 0.5, "r3": 0.3})
    assert _run(engine, reqs) != plain


def test_v4_sampled_requests_finish_and_return_everything(v4_mtp):
    reqs = [
        (p, SamplingParams(max_tokens=10, temperature=0.9, top_k=50, seed=i, ignore_eos=True))
        for i, (p, _) in enumerate(_requests(4, n=3))
    ]
    engine = _engine(v4_mtp, True, steps=2)
    outs = _run(engine, reqs)
    assert all(len(v[0]) == 10 and v[2] == "length" for v in outs.values())
    _slots_back(engine)


def _transformers_names(w: dict) -> dict:
    """mtp.0.* in release names -> model.mtp.0.* in transformers' module names (what our reader
    maps back with release_name), experts fused as transformers stores them."""
    ren = [
        (".attn.", ".self_attn."),
        (".ffn.", ".mlp."),
        (".attn_norm.", ".input_layernorm."),
        (".ffn_norm.", ".post_attention_layernorm."),
        (".wq_a.", ".q_a_proj."),
        (".wq_b.", ".q_b_proj."),
        (".wkv.", ".kv_proj."),
        (".wo_a.", ".o_a_proj."),
        (".wo_b.", ".o_b_proj."),
        (".q_norm.", ".q_a_norm."),
        (".kv_norm.", ".norm."),
        (".attn_sink", ".sinks"),
        (".gate.bias", ".gate.e_score_correction_bias"),
        (".shared_experts.w1.", ".shared_experts.gate_proj."),
        (".shared_experts.w2.", ".shared_experts.down_proj."),
        (".shared_experts.w3.", ".shared_experts.up_proj."),
    ]
    out, experts = {}, {}
    for k, v in w.items():
        if not k.startswith("mtp.0."):
            out[k] = v
            continue
        n = "model." + k
        if ".ffn.experts." in n:
            _, e, which, _ = n.rsplit(".", 3)
            experts.setdefault(int(e), {})[which] = v
            continue
        for a, b in ren:
            n = n.replace(a, b)
        for site in ("attn", "ffn"):
            for part in ("fn", "base", "scale"):
                n = n.replace(f".hc_{site}_{part}", f".{site}_hc.{part}")
        out[n] = v
    E = len(experts)
    out["model.mtp.0.mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([experts[e]["w1"], experts[e]["w3"]]) for e in range(E)]
    )
    out["model.mtp.0.mlp.experts.down_proj"] = torch.stack([experts[e]["w2"] for e in range(E)])
    return out


def test_v4_mtp_block_loads_from_release_and_transformers_layouts(v4_mtp, tmp_path):
    from safetensors.torch import load_file, save_file

    from dsv4_engine.spec_decode.mtp_v4 import load_v4_mtp_weights

    hf = tmp_path / "hf"
    shutil.copytree(v4_mtp, hf)
    w = load_file(str(hf / "model.safetensors"))
    save_file(_transformers_names(w), str(hf / "model.safetensors"))
    release, renamed = load_v4_mtp_weights(v4_mtp, 0, 4), load_v4_mtp_weights(hf, 0, 4)
    assert set(release) == set(renamed) and len(release) > 20
    assert all(torch.equal(release[k], renamed[k]) for k in release)
    reqs = _boundary_requests(2)[:3]
    assert _run(_engine(hf, True, steps=2), reqs) == _run(_engine(v4_mtp, False), reqs)


def test_v4_refusals_at_start(v4_mtp, tmp_path):
    from safetensors.torch import load_file, save_file

    with pytest.raises(ValueError, match="smallest ring"):
        _engine(v4_mtp, True, steps=8)  # v4-tiny's rings hold 8 positions: 8 drafts + 1 do not fit
    from dsv4_engine.spec_decode.options import engine_refusal

    assert (
        engine_refusal("mtp", 2, "deepseek_v4", 1, "mono", 2) is None
    )  # TP: tests/unit/parallel/test_tp_spec_decode.py
    broken = tmp_path / "compressed"
    shutil.copytree(v4_mtp, broken)
    w = load_file(str(broken / "model.safetensors"))
    w["mtp.0.attn.compressor.wkv.weight"] = torch.zeros(64, 128)
    save_file(w, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="compressor"):
        _engine(broken, True, steps=2)
    gone = tmp_path / "gone"
    shutil.copytree(v4_mtp, gone)
    save_file({k: v for k, v in w.items() if not k.startswith("mtp.")}, str(gone / "model.safetensors"))
    with pytest.raises(ValueError, match="no mtp.0"):
        _engine(gone, True, steps=2)


def test_v4_aborts_mid_speculation_return_everything_and_leave_others_exact(v4_mtp):
    """Requests aborted while they have drafts in flight give back their pages, slot rows and
    drafts; the others still equal plain decoding (their rows were never touched)."""
    import threading
    import time

    from dsv4_engine.sequence import Sequence

    reqs = _boundary_requests(3)
    for _, p in reqs:
        p.max_tokens = 24
    plain = _run(_engine(v4_mtp, False), reqs)
    engine = _engine(v4_mtp, True, steps=3)
    outs: dict = {}
    done = threading.Event()
    aborted = {"r1", "r4", "r6"}

    def sink(o):
        toks, reason = outs.get(o.rid, ([], None))
        outs[o.rid] = (toks + list(o.token_ids), o.finish_reason)
        if o.rid in aborted and len(outs[o.rid][0]) >= 4 and o.finish_reason is None:
            engine.abort(o.rid)
        if sum(v[1] is not None for v in outs.values()) == len(reqs):
            done.set()

    engine.start()
    try:
        for i, (prompt, params) in enumerate(reqs):
            engine.submit(Sequence(f"r{i}", prompt, params, sink=sink))
        assert done.wait(120)
        deadline = time.monotonic() + 5
        # the last step may still hold its batch (and so its requests, which key the drafts)
        # for a moment after the last output: wait for the step to end, not only for the pages
        while (
            engine.pool.allocator.num_free != engine.pool.num_pages or len(engine.spec.drafts)
        ) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.pool.allocator.num_free == engine.pool.num_pages
        _slots_back(engine)
        assert not engine.seqs and len(engine.spec.drafts) == 0
    finally:
        engine.stop()
    for rid, (toks, reason) in outs.items():
        if rid in aborted:
            assert reason == "abort" and toks == plain[rid][0][: len(toks)] and len(toks) < 24
        else:
            assert (toks, reason) == (plain[rid][0], "length")


@pytest.mark.slow
def test_v4_speculation_on_the_kernel_path_equals_plain(v4_mtp):
    """The Triton kernel path (on CPU: its interpreter, ~90 s): verify extends, window closing in
    the compressor kernels, the MTP block's ring, all with drafts steered to be partly rejected."""
    reqs = [
        ([5, 9, 77, 31, 200, 18, 44, 61, 90], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)),
        ([7, 8, 9, 10, 11, 12, 13], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)),
    ]
    plain = _run(_engine(v4_mtp, False, kernel_backend="triton"), reqs, timeout=900)
    engine = _engine(v4_mtp, True, steps=2, kernel_backend="triton")
    _steer(engine, plain, {"r0": 0.5, "r1": 0.7})
    assert _run(engine, reqs, timeout=900) == plain
    t = engine.metrics.totals
    assert 0 < t["spec_decode_num_accepted_tokens"] < t["spec_decode_num_draft_tokens"]
    _slots_back(engine)


def _first_drafts(engine) -> dict:
    """(request, tokens emitted so far) -> the first draft verified at that point."""
    seen: dict = {}
    spec, original = engine.spec, engine.spec.lookahead

    def lookahead(seq):
        n = original(seq)
        if n:
            seen[(seq.rid, len(seq.output_ids))] = spec.drafts[seq].tokens[0]
        return n

    spec.lookahead = engine.scheduler.lookahead = lookahead
    return seen


def test_v4_mtp_ring_survives_the_draft_chain(v4_mtp, monkeypatch):
    """The first draft at a point depends only on the MTP block's ring over valid positions, so
    K=3 (a chain of 2 more steps writing past them) drafts it as K=1 (no chain) does; without
    putting back what the chain overwrote in the block's ring, it does not."""
    from dsv4_engine.spec_decode import mtp_v4

    reqs = _boundary_requests(5)[2:6]

    def firsts(k: int) -> dict:
        engine = _engine(v4_mtp, True, steps=k)
        seen = _first_drafts(engine)
        _run(engine, reqs)
        return seen

    one, three = firsts(1), firsts(3)
    common = set(one) & set(three)
    assert len(common) > 20 and all(one[p] == three[p] for p in common)
    original = mtp_v4.RingRollback.restore
    monkeypatch.setattr(
        mtp_v4.RingRollback,
        "restore",
        lambda self, keep_below=None: None if keep_below is None else original(self, keep_below),
    )
    broken = firsts(3)
    common = set(one) & set(broken)
    assert any(one[p] != broken[p] for p in common)
