"""Speculative decoding with the MTP layer: greedy output equals plain decoding token for token
(whatever the drafts: the real drafter, or drafts steered to be right, wrong or half right per
request), under concurrency, preemption, stop strings and max_tokens, with every page back; the
rejection sampler keeps the target's distribution; what is not built yet is refused at start
(structured outputs and logits processing: tests/unit/engine/test_spec_decode_logits.py)."""

from __future__ import annotations

import random
import re
import threading
import time

import pytest
import torch

from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence
from dsv4_engine.spec_decode.options import engine_refusal, normalize_algorithm
from dsv4_engine.spec_decode.verify import accept_greedy, rejection_sample, sampling_probs
from spec_testutil import run_all as _run
from spec_testutil import spec_engine as _engine
from spec_testutil import steer as _steer


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only contend on these shared cores
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory):
    from dsv4_engine.checkpoint import init_checkpoint

    return init_checkpoint(tmp_path_factory.mktemp("mtp") / "tiny-mtp", preset="tiny", seed=0, mtp=True)


def _requests(seed: int = 0, n: int = 6):
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(2, 500) for _ in range(rng.randint(3, 30))],
            SamplingParams(max_tokens=rng.randint(5, 24), temperature=0, ignore_eos=True),
        )
        for _ in range(n)
    ]


def test_greedy_with_the_real_drafter_equals_plain_decoding(tiny_mtp):
    reqs = _requests(1)
    plain = _run(_engine(tiny_mtp, False), reqs)
    spec_engine = _engine(tiny_mtp, True, steps=2)
    spec = _run(spec_engine, reqs)
    assert spec == plain
    totals = spec_engine.metrics.totals
    assert totals["spec_decode_num_draft_tokens"] > 0  # it did speculate
    assert spec_engine.loads()["speculative"]["mean_acceptance_length"] >= 1


def test_greedy_equals_plain_with_different_acceptance_per_request_and_preemption(tiny_mtp):
    reqs = _requests(2, n=6)
    # Few pages: requests are preempted and recomputed on the way (drafts' pages included).
    plain = _run(_engine(tiny_mtp, False, kv_pages=14), reqs)
    engine = _engine(tiny_mtp, True, steps=3, kv_pages=14)
    _steer(engine, plain, {"r0": 1.0, "r1": 0.0, "r2": 0.5, "r3": 0.8, "r4": 1.0, "r5": 0.3})
    preempted = []
    preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: (preempted.append(seq.rid), preempt(seq))
    spec = _run(engine, reqs)
    assert spec == plain
    assert preempted, "the pool was meant to be small enough to preempt"
    for rid, (toks, _, reason, _) in spec.items():
        assert reason == "length" and len(toks) == reqs[int(rid[1:])][1].max_tokens
    t = engine.metrics.totals
    assert 0 < t["spec_decode_num_accepted_tokens"] < t["spec_decode_num_draft_tokens"]
    mean = engine.loads()["speculative"]["mean_acceptance_length"]
    assert 1 < mean < 4


def test_stop_strings_and_max_tokens_are_never_passed(tiny_mtp):
    base = _requests(3, n=4)
    plain = _run(_engine(tiny_mtp, False), base)
    # A stop string from the middle of each plain answer, and max_tokens that cut a verify step.
    reqs = []
    for i, (prompt, p) in enumerate(base):
        text = plain[f"r{i}"][1]
        # Plain letters (a byte-level BPE's partial characters decode as U+FFFD until completed).
        found = re.search(r"[A-Za-z]{3}", text[len(text) // 3 :])
        stop = [found.group(0)] if i % 2 == 0 and found else []
        reqs.append((prompt, SamplingParams(max_tokens=p.max_tokens - i, temperature=0, ignore_eos=True, stop=stop)))
    plain = _run(_engine(tiny_mtp, False), reqs)
    engine = _engine(tiny_mtp, True, steps=3)
    _steer(engine, plain, {f"r{i}": 1.0 for i in range(4)})  # every draft right: steps emit 4 tokens
    spec = _run(engine, reqs)
    assert spec == plain
    assert sum(bool(p.stop) for _, p in reqs) >= 1
    for i, (_, p) in enumerate(reqs):
        toks, text, reason, _ = spec[f"r{i}"]
        assert len(toks) <= p.max_tokens
        if p.stop:
            assert reason == "stop" and p.stop[0] not in text


def test_sampled_requests_finish_and_return_pages(tiny_mtp):
    reqs = [
        (p, SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.95, seed=i, ignore_eos=True))
        for i, (p, _) in enumerate(_requests(4, n=4))
    ]
    outs = _run(_engine(tiny_mtp, True, steps=2), reqs)
    assert all(len(v[0]) == 12 and v[2] == "length" for v in outs.values())


def test_refusals_at_start(tiny_mtp, tiny_model):
    assert normalize_algorithm("EAGLE") == normalize_algorithm("NEXTN") == normalize_algorithm("deepseek_mtp") == "mtp"
    assert normalize_algorithm(None) is None
    with pytest.raises(ValueError, match="not supported"):
        normalize_algorithm("medusa")
    assert engine_refusal("mtp", 2, "deepseek_v4", 1, "mono", 1) is None  # V4: tests/unit/engine/test_spec_decode_v4.py
    assert "not supported" in engine_refusal("mtp", 2, "llama", 1, "mono", 1)
    assert (
        engine_refusal("mtp", 2, "deepseek_v3", 1, "decode", 1) is None
    )  # PD: tests/unit/engine/test_spec_decode_pd.py
    assert (
        engine_refusal("mtp", 2, "deepseek_v3", 1, "mono", 2) is None
    )  # TP: tests/unit/parallel/test_tp_spec_decode.py
    assert "between 1 and" in engine_refusal("mtp", 0, "deepseek_v3", 1, "mono", 1)
    assert engine_refusal("mtp", 2, "deepseek_v3", 1, "mono", 1) is None
    with pytest.raises(ValueError, match="MTP layer"):
        _engine(tiny_model, True)  # the default tiny preset has no MTP layer


def test_accept_greedy():
    assert accept_greedy([], [4]) == [4]
    assert accept_greedy([1, 2, 3], [1, 2, 3, 9]) == [1, 2, 3, 9]
    assert accept_greedy([1, 5, 3], [1, 2, 3, 9]) == [1, 2]
    assert accept_greedy([7, 2], [1, 2, 3]) == [1]


# chi-square critical values at significance 1e-3 (df = vocab - 1)
CHI2_CRIT_1E3 = {4: 18.467, 5: 20.515}


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("k", [1, 3])
def test_rejection_sampling_keeps_the_target_distribution(k):
    """Drafts drawn from a q far from p: every emitted position is distributed as p there (the
    first always; later ones given the drafts before them were kept). 20k trials, chi-square."""
    V, trials = 5, 8000
    g = torch.Generator().manual_seed(1234)
    p = torch.softmax(torch.randn(k + 1, V, generator=g) * 1.5, dim=-1).double()
    q = torch.softmax(torch.randn(k, V, generator=g) * 1.5, dim=-1).double()
    all_drafts = torch.multinomial(q, trials, replacement=True, generator=g).T.tolist()  # [trials, k]
    firsts = torch.zeros(V, dtype=torch.float64)
    seconds = torch.zeros(V, dtype=torch.float64)
    lengths = []
    for drafts in all_drafts:
        out = rejection_sample(p, q, drafts, g)
        assert 1 <= len(out) <= k + 1 and out[:-1] == drafts[: len(out) - 1]
        firsts[out[0]] += 1
        lengths.append(len(out))
        if len(out) > 1 and k > 1:  # position 1 given the first draft was kept
            seconds[out[1]] += 1
    assert _chi2(firsts, p[0]) < CHI2_CRIT_1E3[V - 1]
    if k > 1:
        assert _chi2(seconds, p[1]) < CHI2_CRIT_1E3[V - 1]
    # The chance a draft is kept is sum_x min(p, q): the mean accepted count follows it.
    keep0 = float(torch.minimum(p[0], q[0]).sum())
    kept_first = sum(n > 1 for n in lengths) / trials if k else 0
    assert abs(kept_first - keep0) < 4 * (keep0 * (1 - keep0) / trials) ** 0.5


def test_rejection_sampling_with_no_drafts_samples_the_target():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.0]], dtype=torch.float64)
    counts = torch.zeros(5, dtype=torch.float64)
    for _ in range(8000):
        counts[rejection_sample(p, p[:0], [], g)[0]] += 1
    assert counts[4] == 0
    assert _chi2(counts[:4], p[0, :4]) < 16.266  # df 3


def test_sampling_probs_matches_temperature_top_k_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    pr = sampling_probs(logits, [0.5], [2], [1.0])
    ref = torch.softmax(torch.tensor([4.0, 2.0]), 0)
    assert torch.allclose(pr[0, :2], ref) and pr[0, 2:].sum() == 0
    pr = sampling_probs(logits, [1.0], [-1], [0.5])
    assert pr[0, 0] == 1.0


def test_logprobs_of_accepted_tokens_equal_plain_decoding(tiny_mtp):
    reqs = [
        (p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)) for p, _ in _requests(5, n=3)
    ]
    got = {}
    for spec in (False, True):
        engine = _engine(tiny_mtp, spec, steps=3)
        logprobs: dict = {}
        done = threading.Event()

        def sink(o, logprobs=logprobs, done=done):
            logprobs.setdefault(o.rid, []).extend(o.logprobs or [])
            if o.finished and len([r for r in logprobs if r.endswith("!")]) + 1 == len(reqs):
                done.set()
            if o.finished:
                logprobs[o.rid + "!"] = []

        if spec:
            plain_tokens = {
                rid: ([e["token_id"] for e in v], "", None, None)
                for rid, v in got[False].items()
                if not rid.endswith("!")
            }
            _steer(engine, plain_tokens, {"r0": 1.0, "r1": 0.5, "r2": 0.0})
        engine.start()
        try:
            for i, (p, params) in enumerate(reqs):
                engine.submit(Sequence(f"r{i}", p, params, sink=sink))
            assert done.wait(60)
        finally:
            engine.stop()
        got[spec] = logprobs
    for rid in ("r0", "r1", "r2"):
        a, b = got[False][rid], got[True][rid]
        assert [e["token_id"] for e in a] == [e["token_id"] for e in b] and len(a) == 10
        for x, y in zip(a, b):  # the same position's logits, computed in a 1-token or a 4-token extend
            assert abs(x["logprob"] - y["logprob"]) < 1e-4
            assert [t for t, _ in x["top"]] == [t for t, _ in y["top"]]


def test_sharded_and_fp8_checkpoints_load_their_mtp_layer(tiny_mtp, tmp_path):
    """The MTP block read from a sharded (model.safetensors.index.json) folder, as releases ship,
    and from an fp8 block-quantized one: the engine speculates with both."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from dsv4_engine.checkpoint import init_checkpoint

    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_mtp, sharded)
    weights = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for f, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(sharded / f))
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}})
    )
    fp8 = init_checkpoint(tmp_path / "fp8", preset="tiny", seed=0, mtp=True, quant="fp8")
    for model in (sharded, fp8):
        reqs = _requests(6, n=2)
        assert _run(_engine(model, True, steps=2), reqs) == _run(_engine(model, False), reqs)


def test_choices_sharing_a_prompt_speculate_like_plain_decoding(tiny_mtp):
    """n > 1: the other choices reuse the first one's prompt pages (share_prefix_of), including
    the MTP state written there; greedy choices all equal plain decoding."""
    prompt = list(range(7, 47))  # 40 tokens: several full pages of 8 to share
    outs = {}
    for spec in (False, True):
        engine = _engine(tiny_mtp, spec, steps=2)
        got: dict = {}
        done = threading.Event()

        def sink(o, got=got, done=done):
            toks, fin = got.get(o.rid, ([], False))
            got[o.rid] = (toks + list(o.token_ids), o.finished)
            if all(v[1] for v in got.values()) and len(got) == 3:
                done.set()

        engine.start()
        try:
            for i in range(3):
                seq = Sequence(
                    f"c{i}", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), sink=sink
                )
                seq.share_prefix_of = "c0" if i else None
                engine.submit(seq)
            assert done.wait(60)
            deadline = time.monotonic() + 5
            while engine.pool.allocator.num_free != engine.pool.num_pages and time.monotonic() < deadline:
                time.sleep(0.01)
            assert engine.pool.allocator.num_free == engine.pool.num_pages
        finally:
            engine.stop()
        outs[spec] = got
    assert outs[True] == outs[False] and len({tuple(v[0]) for v in outs[True].values()}) == 1
