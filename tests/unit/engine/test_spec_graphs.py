"""Capture safety of the speculator's verify and draft steps (DeepSeek-V3), checked on CPU as
test_cuda_graphs.py checks the plain decode step: two steps of different content (other drafts,
other acceptance, other pages) padded to one row bucket issue the same ops with the same shapes
and the same kernel launches and read nothing back to the host (the Triton backend under the
interpreter); the padded static-buffer steps give the eager steps' hidden states, logits and
cache writes; an engine whose speculator runs every step it can through them emits the plain
engine's greedy tokens."""

from __future__ import annotations

import pytest
import torch
from host_sync_probe import count_host_syncs
from test_cuda_graphs import Trace, assert_same_writes, launches, reorder_tol  # noqa: F401 (fixture)
from test_graph_capture import cuda_recorded  # noqa: F401 (fixture)
from test_spec_decode import _engine, _requests, _run, _steer, one_thread, tiny_mtp  # noqa: F401 (fixtures)
from test_spec_decode_v4 import _boundary_requests, v4_mtp  # noqa: F401 (fixture)

from dsv4_engine.cuda_graphs import DECODE_DISPATCHES_PER_LAYER, bucket_for, pad_decode
from dsv4_engine.kv_cache import KVPool
from dsv4_engine.model_runner import ModelRunner
from dsv4_engine.spec_decode.graphs import ExtendGraphs, SpecGraphs, spec_buckets, widened
from dsv4_engine.spec_decode.mtp_layer import mtp_state_spec
from dsv4_engine.spec_decode.mtp_v4 import v4_mtp_state_spec
from dsv4_engine.spec_decode.speculator import MTPSpeculator

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
K = 3


def test_spec_buckets():
    assert spec_buckets(8, 3) == [1, 2, 4, 8, 16, 32]  # one row a request, or k + 1
    assert spec_buckets(20, 1)[-3:] == [20, 32, 40]
    assert spec_buckets(1, 2) == [1, 3]


@pytest.fixture(scope="module")
def spec(tiny_mtp):
    runner = ModelRunner(tiny_mtp, "float32", str(DEVICE), "triton")
    s = MTPSpeculator(runner, str(tiny_mtp), K)
    s.state_specs = [mtp_state_spec(runner.cfg)]
    return s


def _pool(spec, seed: int) -> KVPool:
    pool = KVPool(spec.runner.state_specs + spec.state_specs, 16, 8, torch.float32, DEVICE)
    torch.manual_seed(seed)
    for t in pool.all_states.values():  # any cached content: the trace must not care
        t.normal_()
    return pool


def _rows(spec, reqs, page_size=8, slots=None):
    """A one-token-row step as the speculator builds it: reqs are (first position, token ids,
    pages); verify rows (the last token then its drafts) or catch-up rows alike."""
    hb, one_token_rows = spec._batch(
        [s for s, _, _ in reqs], [len(t) for _, t, _ in reqs], [p for _, _, p in reqs],
        [t for _, t, _ in reqs], slots or [None] * len(reqs), page_size,
    )  # fmt: skip
    assert one_token_rows
    return hb


# Steps of different content (tokens, positions, pages, requests, drafts, acceptance) in one row
# bucket, 2, since the Triton interpreter's time grows with the rows (a layer of 4 rows: ~3 s).
# What padding does is checked against the eager steps below.
VERIFY_ONE = [(3, [8, 1], [0])]  # one request verifying one draft
VERIFY_TWO = [(40, [9], [12, 13, 14, 15, 0, 1]), (18, [9], [1, 2, 3])]  # two that drafted nothing
CHAIN = [(7, [4], [0, 1]), (21, [9], [1, 2, 3])]  # a chained draft step: one row a request
CATCH_UP = [(18, [9, 4], [1, 2, 3])]  # a request whose one draft was accepted: its 2 new positions
# For the equality with the eager steps: 3 rows in bucket 4, one padding row.
VERIFY_THREE = [(18, [9, 4], [1, 2, 3]), (40, [1], [12, 13, 14, 15, 0, 1])]
CHAIN_THREE = [(7, [4], [0, 1]), (21, [9], [1, 2, 3]), (5, [3], [11])]


def _trace(graphs, g, hb, launches, prev=None):
    """What graph g captures: its forward over the static buffers, once they hold the step."""
    n = hb.input_ids.shape[0]
    bs = bucket_for(n, g.buckets)
    g.inputs.load(pad_decode(widened(hb, g.width), bs))
    if prev is not None:
        graphs.prev[:n].copy_(prev)
    launches.clear()
    with count_host_syncs() as syncs, Trace() as trace:
        out = g.run_forward(g.inputs.view(bs), bs)
    return out[:n], trace.events + list(launches), syncs


def _same_capture(graphs, g, one, two, launches, prev=False):
    spec_hidden = graphs.spec.runner.cfg.hidden_size
    h = graphs.prev.shape[1:]
    p1 = torch.randn(one.input_ids.shape[0], *h) if prev else None
    p2 = torch.randn(two.input_ids.shape[0], *h) if prev else None
    assert bucket_for(one.input_ids.shape[0], g.buckets) == bucket_for(two.input_ids.shape[0], g.buckets)
    out1, trace1, syncs1 = _trace(graphs, g, one, launches, p1)
    out2, trace2, syncs2 = _trace(graphs, g, two, launches, p2)
    assert syncs1 == [] and syncs2 == [], "\n".join(syncs1 + syncs2)
    assert out1.shape[0] == one.input_ids.shape[0] and out1.shape[-1] == spec_hidden
    assert out2.shape[0] == two.input_ids.shape[0]
    assert len(trace1) == len(trace2)
    for i, (x, y) in enumerate(zip(trace1, trace2)):
        assert x == y, f"dispatch {i} differs between two steps of one bucket: {x} vs {y}"
    assert any(e[0] == "launch" for e in trace1), "the Triton kernels ran (the path a GPU captures)"
    return trace1


def test_verify_step_is_capture_safe(spec, launches):
    pool = _pool(spec, 0)
    graphs = SpecGraphs(spec, pool.page_size, pool.num_pages, 8, capture=False)
    graphs.states = pool.all_states
    one, two = _rows(spec, VERIFY_ONE), _rows(spec, VERIFY_TWO)
    trace = _same_capture(graphs, graphs.verify, one, two, launches)
    layers = spec.runner.cfg.num_hidden_layers
    assert len(trace) / layers <= DECODE_DISPATCHES_PER_LAYER, "the plain decode step's budget a layer"


def test_draft_step_is_capture_safe(spec, launches):
    """A chained step (one row a request) and a catch-up (1..k+1 rows a request, as many as the
    verify made valid) are the same graph."""
    pool = _pool(spec, 1)
    graphs = SpecGraphs(spec, pool.page_size, pool.num_pages, 8, capture=False)
    graphs.states = pool.all_states
    trace = _same_capture(graphs, graphs.draft, _rows(spec, CHAIN), _rows(spec, CATCH_UP), launches, prev=True)
    # One MoE layer (more than the average layer), the block's input norms and projection: 127 measured.
    assert len(trace) <= DECODE_DISPATCHES_PER_LAYER + 30


def _restore(pool, snapshot):
    for k, v in pool.all_states.items():
        v.copy_(snapshot[k])


@pytest.fixture(scope="module")
def torch_spec(tiny_mtp):
    """The torch backend: the padding and the static buffers are what this checks, in seconds."""
    runner = ModelRunner(tiny_mtp, "float32", str(DEVICE), "torch")
    s = MTPSpeculator(runner, str(tiny_mtp), K)
    s.state_specs = [mtp_state_spec(runner.cfg)]
    return s


def test_padded_static_steps_give_the_eager_steps_outputs_and_writes(torch_spec):
    """Verify, catch-up and a chained step (3 rows each, in bucket 4) through the
    static buffers against the speculator's eager forwards: the same hidden states and logits,
    and the same cache: padding rows write only what row 0 writes."""
    spec = torch_spec
    pool = _pool(spec, 2)
    graphs = SpecGraphs(spec, pool.page_size, pool.num_pages, 8, capture=False)
    used = _counting(graphs)
    tol = reorder_tol(spec.runner)
    H = spec.runner.cfg.hidden_size
    catch = VERIFY_THREE  # as if every draft was accepted: 3 rows
    last = torch.tensor([1, 2])  # each request's last
    cases = [
        lambda: spec._hidden(_rows(spec, VERIFY_THREE), True, pool),
        lambda: spec._mtp_forward(_rows(spec, catch), True, pool, torch.linspace(-1, 1, 3 * H).view(3, H), last),
        lambda: spec._mtp_forward(_rows(spec, CHAIN_THREE), True, pool, torch.linspace(1, -1, 3 * H).view(3, H)),
    ]
    for n, run in enumerate(cases):
        snapshot = {k: v.clone() for k, v in pool.all_states.items()}
        spec.graphs = None
        eager = run()
        after_eager = {k: v.clone() for k, v in pool.all_states.items()}
        _restore(pool, snapshot)
        spec.graphs = graphs
        before = sum(used.values())
        try:
            static = run()
        finally:
            spec.graphs = None
        assert sum(used.values()) == before + 1, "the step ran through the static buffers"
        static, eager = (
            (static if isinstance(static, tuple) else (static,)),
            (eager if isinstance(eager, tuple) else (eager,)),
        )
        for a, b in zip(static, eager, strict=True):
            torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=f"case {n}")
        for k, v in pool.all_states.items():
            assert_same_writes(v, snapshot[k], after_eager[k], tol, f"case {n}: {k}")


def _counting(graphs: SpecGraphs) -> dict:
    """How many steps each of graphs' sets ran, counted as they run."""
    used = {"verify": 0, "draft": 0, "catch_up": 0}
    for name in used:
        g = getattr(graphs, name)
        if g is None:  # V3 has no catch-up set: its catch-up is one-token rows, the draft's
            continue
        step = g.step
        g.step = lambda hb, step=step, name=name: (used.__setitem__(name, used[name] + 1), step(hb))[1]
    return used


def _with_graphs(engine, max_bs: int = 4) -> dict:
    """Run the engine's speculator through static-buffer graphs (what a GPU replays), with
    buckets up to max_bs requests (V3: 4 * (k + 1) rows): larger steps run eagerly. Counts the
    steps that took them."""
    graphs = SpecGraphs(engine.spec, engine.pool.page_size, engine.pool.num_pages, max_bs, capture=False)
    engine.spec.graphs = graphs
    return _counting(graphs)


def test_greedy_with_graphs_equals_plain_decoding(tiny_mtp):
    reqs = _requests(5, n=6)  # max_tokens 5..24: near its end a request drafts fewer than k
    plain = _run(_engine(tiny_mtp, False), reqs)
    engine = _engine(tiny_mtp, True, steps=K)
    used = _with_graphs(engine)
    assert _run(engine, reqs) == plain
    assert used["verify"] > 0 and used["draft"] > 0


def test_greedy_with_graphs_and_mixed_acceptance_and_preemption(tiny_mtp):
    reqs = _requests(2, n=6)
    plain = _run(_engine(tiny_mtp, False, kv_pages=14), reqs)
    engine = _engine(tiny_mtp, True, steps=K, kv_pages=14)
    _steer(engine, plain, {"r0": 1.0, "r1": 0.0, "r2": 0.5, "r3": 0.8, "r4": 1.0, "r5": 0.3})
    used = _with_graphs(engine)
    assert _run(engine, reqs) == plain
    assert used["verify"] > 0 and used["draft"] > 0
    t = engine.metrics.totals
    assert 0 < t["spec_decode_num_accepted_tokens"] < t["spec_decode_num_draft_tokens"]


def test_both_sets_are_captured_or_neither(torch_spec, cuda_recorded):
    """Every bucket of verify and draft captured (torch.cuda's graph calls recorded, the forwards
    run), the warm-ups' writes zeroed; a failure in the draft set drops the verify set too and
    says which graph failed, in one line."""
    spec = torch_spec
    pool = _pool(spec, 6)
    graphs = SpecGraphs(spec, pool.page_size, pool.num_pages, 1, capture=False)
    assert graphs.buckets == [1, 4]  # one request: its decode, or its verify with k drafts
    for g in graphs.sets:
        g.capture, g._synchronize = True, lambda: None  # what a CUDA device gets
    assert graphs.capture_all(pool) is None and graphs.captured
    assert all(sorted(g.graphs) == graphs.buckets for g in graphs.sets)
    assert not any(t.any() for t in pool.all_states.values()) and not graphs.prev.any()
    assert len(cuda_recorded) == 2 * len(graphs.buckets)  # one capture per bucket of each set

    failing = SpecGraphs(spec, pool.page_size, pool.num_pages, 1, capture=False)
    for g in failing.sets:
        g.capture, g._synchronize = True, lambda: None
    real = failing.draft._capture_one
    failing.draft._capture_one = lambda bs: (_ for _ in ()).throw(RuntimeError("boom\nmore")) if bs == 1 else real(bs)
    reason = failing.capture_all(pool)
    assert reason == "capturing the speculative draft graph of batch size 1 failed: RuntimeError: boom"
    assert not failing.captured and not failing.verify.graphs and not failing.draft.graphs


def test_a_speculating_engine_captures_its_steps_instead_of_the_plain_decode(tiny_mtp, monkeypatch):
    monkeypatch.setattr(ModelRunner, "graphs_supported", lambda self: True)
    monkeypatch.setattr(ModelRunner, "capture_graphs", lambda self, pool: pytest.fail("captured the plain decode"))
    seen = []
    monkeypatch.setattr(SpecGraphs, "capture_all", lambda self, pool, agree: seen.append(pool))
    monkeypatch.setattr(SpecGraphs, "captured", property(lambda self: True))
    reqs = _requests(6, n=3)
    plain = _run(_engine(tiny_mtp, False, cuda_graph_max_bs=0), reqs)  # graphs are on by default
    engine = _engine(tiny_mtp, True, steps=K, cuda_graph_max_bs=4)
    assert seen == [engine.pool] and engine.spec.graphs is not None
    used = _counting(engine.spec.graphs)  # not captured on CPU: the same padded steps, eagerly
    assert _run(engine, reqs) == plain
    assert used["verify"] > 0 and used["draft"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU to capture")
def test_captured_spec_graphs_give_the_eager_greedy_tokens(tiny_mtp):
    reqs = _requests(1, n=6)
    common = dict(device="cuda", kernel_backend="triton", dtype="float32")
    eager = _run(_engine(tiny_mtp, True, steps=K, **common), reqs)
    engine = _engine(tiny_mtp, True, steps=K, cuda_graph_max_bs=8, **common)
    assert engine.spec.graphs is not None and engine.spec.graphs.captured
    used = _counting(engine.spec.graphs)
    assert _run(engine, reqs) == eager
    assert used["verify"] > 0 and used["draft"] > 0


# ---- DeepSeek-V4: the chained draft steps (one row a request, the MTP block's ring a slot state)
# and the verify (k + 1 rows a request: test_spec_graphs_v4_verify.py checks the step itself)


@pytest.fixture(scope="module")
def v4_spec(v4_mtp):
    runner = ModelRunner(v4_mtp, "float32", str(DEVICE), "triton")
    s = MTPSpeculator(runner, str(v4_mtp), K)
    s.state_specs = [v4_mtp_state_spec(runner.cfg)]
    return s


def _v4_pool(spec, seed: int) -> KVPool:
    pool = KVPool(spec.runner.state_specs + spec.state_specs, 16, 8, torch.float32, DEVICE, max_num_seqs=6)
    torch.manual_seed(seed)
    for t in pool.all_states.values():
        t.normal_()
    return pool


def test_v4_draft_step_is_capture_safe(v4_spec, launches):
    pool = _v4_pool(v4_spec, 3)
    graphs = SpecGraphs(v4_spec, pool.page_size, pool.num_pages, 8, capture=False)
    assert graphs.buckets == [1, 2, 4, 8]  # the verify's are the same, counted in requests of k + 1 rows
    assert isinstance(graphs.verify, ExtendGraphs) and graphs.verify.buckets == graphs.buckets
    graphs.states = pool.all_states
    one = _rows(v4_spec, CHAIN, slots=[0, 1])
    two = _rows(v4_spec, [(3, [5], [4]), (14, [8], [5, 6])], slots=[4, 2])  # a ring that wraps (window 8)
    _same_capture(graphs, graphs.draft, one, two, launches, prev=True)


def test_v4_padded_static_draft_step_gives_the_eager_steps_outputs_and_writes(v4_mtp):
    runner = ModelRunner(v4_mtp, "float32", str(DEVICE), "torch")
    spec = MTPSpeculator(runner, str(v4_mtp), K)
    spec.state_specs = [v4_mtp_state_spec(runner.cfg)]
    pool = _v4_pool(spec, 4)
    graphs = SpecGraphs(spec, pool.page_size, pool.num_pages, 8, capture=False)
    used = _counting(graphs)
    hb = _rows(spec, CHAIN_THREE, slots=[3, 0, 5])  # 3 rows in bucket 4
    prev = torch.linspace(-1, 1, 3 * runner.cfg.hc_mult * runner.cfg.hidden_size).view(3, runner.cfg.hc_mult, -1)
    snapshot = {k: v.clone() for k, v in pool.all_states.items()}
    eager = spec._mtp_forward(hb, True, pool, prev)
    after_eager = {k: v.clone() for k, v in pool.all_states.items()}
    _restore(pool, snapshot)
    spec.graphs = graphs
    try:
        static = spec._mtp_forward(hb, True, pool, prev)
    finally:
        spec.graphs = None
    assert used["draft"] == 1
    tol = reorder_tol(runner)
    for a, b in zip(static, eager, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    for k, v in pool.all_states.items():
        assert_same_writes(v, snapshot[k], after_eager[k], tol, k)


def test_v4_both_sets_are_captured(v4_mtp, cuda_recorded):
    """Every bucket of the V4 verify and catch-up (k + 1 rows a request, on their own warm-up
    request) and draft captured (torch.cuda's graph calls recorded, the forwards run), the warm-ups' writes zeroed."""
    runner = ModelRunner(v4_mtp, "float32", str(DEVICE), "torch")
    spec = MTPSpeculator(runner, str(v4_mtp), K)
    spec.state_specs = [v4_mtp_state_spec(runner.cfg)]
    pool = _v4_pool(spec, 7)
    graphs = SpecGraphs(spec, pool.page_size, pool.num_pages, 2, capture=False)
    assert graphs.buckets == [1, 2]
    for g in graphs.sets:
        g.capture, g._synchronize = True, lambda: None  # what a CUDA device gets
    assert graphs.capture_all(pool) is None and graphs.captured
    assert all(sorted(g.graphs) == graphs.buckets for g in graphs.sets)
    assert graphs.verify.outputs[2].shape[0] == 2 * (K + 1)  # streams at every row of 2 requests
    assert not any(t.any() for t in pool.all_states.values()) and not graphs.prev.any()
    assert graphs.catch_up.outputs[2].shape[0] == 2 * (K + 1)
    assert not graphs.prev_ext.any()
    assert len(cuda_recorded) == 3 * len(graphs.buckets)  # verify, draft and catch-up


def test_v4_greedy_with_graphs_equals_plain_decoding(v4_mtp):
    """Verify steps of 1..k+1 tokens a request (drafts cut at the prefix cache's boundaries and
    at max_tokens) through the fixed-shape verify, across the window and compression boundaries."""
    reqs = _boundary_requests(0)
    plain = _run(_engine(v4_mtp, False), reqs)
    engine = _engine(v4_mtp, True, steps=K)
    used = _with_graphs(engine, 8)
    assert _run(engine, reqs) == plain
    assert used["draft"] > 0 and used["verify"] > 0  # random drafts: no catch-up past one row


def test_v4_greedy_with_graphs_mixed_acceptance_and_preemption(v4_mtp):
    """Drafts steered right and wrong (the rings and stages rolled back after a captured verify;
    accepted drafts make catch-ups of several positions, through their graph) and a pool small
    enough to preempt."""
    reqs = _boundary_requests(1)
    plain = _run(_engine(v4_mtp, False, kv_pages=12), reqs)
    engine = _engine(v4_mtp, True, steps=K, kv_pages=12)
    _steer(engine, plain, {f"r{i}": a for i, a in enumerate([1.0, 0.0, 0.5, 0.8, 0.3, 0.6, 1.0, 0.2])})
    used = _with_graphs(engine, 8)
    preempted = []
    preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: (preempted.append(seq.rid), preempt(seq))
    assert _run(engine, reqs) == plain
    assert used["draft"] > 0 and used["verify"] > 0 and used["catch_up"] > 0 and preempted
    t = engine.metrics.totals
    assert 0 < t["spec_decode_num_accepted_tokens"] < t["spec_decode_num_draft_tokens"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU to capture")
def test_v4_captured_draft_graphs_give_the_eager_greedy_tokens(v4_mtp):
    reqs = _boundary_requests(2)
    common = dict(device="cuda", kernel_backend="triton", dtype="float32")
    eager = _run(_engine(v4_mtp, True, steps=K, **common), reqs)
    engine = _engine(v4_mtp, True, steps=K, cuda_graph_max_bs=8, **common)
    assert engine.spec.graphs is not None and engine.spec.graphs.captured
    assert sorted(engine.spec.graphs.verify.graphs) == engine.spec.graphs.verify.buckets
    used = _counting(engine.spec.graphs)
    assert _run(engine, reqs) == eager
    assert used["draft"] > 0 and used["verify"] > 0
