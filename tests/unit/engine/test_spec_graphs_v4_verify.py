"""DeepSeek-V4's verify step at a fixed shape (dsv4_engine.layers.v4_verify), the one its CUDA
graph captures (spec_decode.graphs.ExtendGraphs): every request k + 1 rows, windows, rings and
top-k found on the device. Checked on CPU as test_spec_graphs.py checks the other steps:

- the padded static-buffer verify gives the eager extend's hidden streams and logits and leaves
  every state tensor as it leaves them, for requests at positions across v4-tiny's window (8),
  CSA (4, stage ring 8) and HCA (8) boundaries, with 1..k+1 tokens each, past the indexer's
  top-k (4): on the torch path, and on the kernel path (the one a GPU captures);
- two verify steps of different content in one bucket read nothing back to the host and issue
  the same ops and kernel launches (the Triton backend under the interpreter);
- the window-closing candidates match a host enumeration.
Greedy decoding through it equals plain decoding: test_spec_graphs.py's V4 engine tests."""

from __future__ import annotations

import torch
from host_sync_probe import count_host_syncs
from test_cuda_graphs import Trace, assert_same_writes, launches, reorder_tol  # noqa: F401 (fixture)
from test_spec_decode_v4 import v4_mtp  # noqa: F401 (fixture)

from dsv4_engine.batch_buffers import host_batch
from dsv4_engine.cuda_graphs import bucket_for
from dsv4_engine.kv_cache import KVPool
from dsv4_engine.model_runner import ModelRunner
from dsv4_engine.layers.v4_verify import closing_windows
from dsv4_engine.spec_decode.graphs import SpecGraphs, pad_extend, real_rows, widened
from dsv4_engine.spec_decode.mtp_v4 import v4_mtp_state_spec
from dsv4_engine.spec_decode.speculator import MTPSpeculator

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
K = 3
# Dispatches (aten ops, views included, + Triton launches) a V4 verify layer may issue: the V4
# decode layer's budget (cuda_graphs.V4_DECODE_DISPATCHES_PER_LAYER). Measured on v4-tiny at
# k = 1: 1,236 in 4 layers (39 kernel launches), 309 a layer (the decode step: 314).
V4_VERIFY_DISPATCHES_PER_LAYER = 330
PAGE = 8

# (first position, tokens: the last real one then drafts, pages, slot row). Positions cross the
# boundaries: 5..8 closes CSA window 1 and HCA window 0 at 7 and wraps the window ring; 13..15
# closes CSA 3 and HCA 1 at 15; 30 closes nothing; 2..3 closes CSA window 0 (no predecessor);
# 40..43 closes CSA 10 with 10 entries visible (the indexer keeps 4); 22..24 closes CSA 5 at 23.
STEP = [
    (5, [11, 12, 13, 14], [0, 1], 3),
    (13, [21, 22, 23], [2, 3], 0),
    (30, [31], [4, 5, 6, 7], 5),
    (2, [41, 42], [8], 1),
    (40, [51, 52, 53, 54], [9, 10, 11, 12, 13, 14], 2),
]
# Steps of one bucket for the trace, at k = 1 (the interpreter's time grows with the rows: ~2.5 s
# a row): other positions, lengths (2 real rows; 1 and a padding row), pages, slots, and CSA and
# HCA windows closing in one and not in the other.
ONE = [(6, [11, 12], [0, 1], 3)]
TWO = [(41, [51], [9, 10, 11, 12, 13, 14], 2)]
# For the torch path: two requests with fewer than k + 1 tokens.
SHORT = [(14, [21, 22], [2, 3], 0), (41, [51, 52, 53], [9, 10, 11, 12, 13, 14], 2)]


def _spec(model, backend: str, k: int = K) -> MTPSpeculator:
    runner = ModelRunner(model, "float32", str(DEVICE), backend)
    s = MTPSpeculator(runner, str(model), k)
    s.state_specs = [v4_mtp_state_spec(runner.cfg)]
    return s


def _pool(spec, seed: int) -> KVPool:
    pool = KVPool(spec.runner.state_specs + spec.state_specs, 16, PAGE, torch.float32, DEVICE, max_num_seqs=6)
    torch.manual_seed(seed)
    for t in pool.all_states.values():  # any cached content: the trace must not care
        t.normal_()
    return pool


def _batch(reqs):
    return host_batch(
        [s for s, _, _, _ in reqs], [len(t) for _, t, _, _ in reqs], [p for _, _, p, _ in reqs],
        [t for _, t, _, _ in reqs], [sl for _, _, _, sl in reqs], PAGE,
    )  # fmt: skip


def test_closing_windows_match_a_host_enumeration():
    for rate in (1, 2, 4, 8, 128):
        for n in (1, 2, 3, 4):
            starts = torch.arange(0, 3 * rate + 5)
            for m in range(1, n + 1):  # the real run: m of the n rows
                w, closes, req = closing_windows(starts, starts + m, n, rate)
                c = -(-n // rate)
                assert w.shape == closes.shape == req.shape == (starts.shape[0] * c,)
                for b, st in enumerate(starts.tolist()):
                    want = {p // rate for p in range(st, st + m) if (p + 1) % rate == 0}
                    got = w[req == b][closes[req == b]].tolist()
                    assert set(got) == want, (rate, n, m, st)
                    # the others write back an entry of a window closed before (or window 0)
                    others = w[req == b][~closes[req == b]]
                    assert (others <= max((st + m) // rate - 1, 0)).all()


def test_pad_extend_keeps_the_real_rows_and_repeats_request_0():
    hb = _batch(STEP[:3])  # 4, 3 and 1 tokens: 8 rows, 5 in bucket 4 padded to 16
    p = pad_extend(widened(hb, 8), 4, K + 1)
    assert p.extend_lens.tolist() == [4] * 4 and p.seq_lens.tolist() == [9, 16, 31, 9]
    assert p.positions.tolist() == [5, 6, 7, 8, 13, 14, 15, 16, 30, 31, 32, 33, 5, 6, 7, 8]
    assert p.input_ids.tolist() == [11, 12, 13, 14, 21, 22, 23, 23, 31, 31, 31, 31, 11, 12, 13, 14]
    assert p.slot_ids.tolist() == [3, 0, 5, 3]
    rows = real_rows(hb, K + 1)
    assert rows.tolist() == [0, 1, 2, 3, 4, 5, 6, 8]
    assert (p.positions[rows] == hb.positions).all() and (p.input_ids[rows] == hb.input_ids).all()


def test_what_runs_eagerly_is_decided_on_the_host(v4_mtp):
    """A request with more than k + 1 tokens (a longer prefill chunk), more requests than the
    largest bucket, or a padded run past the block table (at the context limit) stays eager."""
    spec = _spec(v4_mtp, "torch")
    graphs = SpecGraphs(spec, PAGE, 16, 2, capture=False)  # buckets 1, 2; table 16 pages wide
    assert graphs.fits(_batch(STEP[:2]), verify=True)
    assert not graphs.fits(_batch([(5, [1, 2, 3, 4, 5], [0, 1], 0)]), verify=True)
    assert not graphs.fits(_batch(STEP[:3]), verify=True)
    last = list(range(16))
    assert graphs.fits(_batch([(16 * PAGE - K - 1, [1, 2], last, 0)]), verify=True)
    assert not graphs.fits(_batch([(16 * PAGE - K, [1, 2], last, 0)]), verify=True)


def _restore(pool, snapshot):
    for k, v in pool.all_states.items():
        v.copy_(snapshot[k])


def _eager_and_static(spec, pool, reqs):
    """The eager extend verify (host lengths) and the padded static-buffer one on the same
    cache: (hidden streams, logits) of each, and the states before, after eager, after static."""
    graphs = SpecGraphs(spec, pool.page_size, pool.num_pages, 8, capture=False)
    hb = _batch(reqs)
    assert graphs.fits(hb, verify=True)
    used = []
    step = graphs.verify.step
    graphs.verify.step = lambda h: (used.append(1), step(h))[1]
    snapshot = {k: v.clone() for k, v in pool.all_states.items()}
    spec.graphs = None
    eager = spec._hidden(hb, False, pool).clone()
    after_eager = {k: v.clone() for k, v in pool.all_states.items()}
    _restore(pool, snapshot)
    spec.graphs = graphs
    try:
        static = spec._hidden(hb, False, pool).clone()
    finally:
        spec.graphs = None
    assert used == [1], "the verify ran through the static buffers"
    lg = spec.target.logits
    return (eager, lg(eager)), (static, lg(static)), snapshot, after_eager


def _check(spec, pool, reqs, writes=("csa_kv", "hca_kv", "swa_kv", "csa_stage", "hca_stage")):
    (eager, el), (static, sl), before, after_eager = _eager_and_static(spec, pool, reqs)
    assert static.shape == eager.shape == (sum(len(t) for _, t, _, _ in reqs), *eager.shape[1:])
    tol = reorder_tol(spec.runner)
    torch.testing.assert_close(static, eager, atol=tol, rtol=tol)
    torch.testing.assert_close(sl, el, atol=tol, rtol=tol)
    assert torch.equal(sl.argmax(-1), el.argmax(-1))
    for k, v in pool.all_states.items():
        assert_same_writes(v, before[k], after_eager[k], tol, k)
    # the step did close windows and write rings (the comparison above is not of no-ops)
    for k in writes:
        assert not torch.equal(after_eager[k], before[k]), k


def test_fixed_verify_equals_the_eager_extend_torch_path(v4_mtp):
    """5 requests in bucket 8 (3 padding requests), 1..4 tokens each, across every boundary."""
    spec = _spec(v4_mtp, "torch")
    _check(spec, _pool(spec, 0), STEP)
    _check(spec, _pool(spec, 1), SHORT)  # every request with fewer than k + 1 tokens


def test_fixed_verify_equals_the_eager_extend_kernel_path(v4_mtp):
    """The same on the kernel path (the Triton backend: what a GPU captures): one request of
    k + 1 tokens past the indexer's top-k, closing a CSA window, in bucket 1. (~20 s alone, most
    of it the interpreter's first run of each kernel; ~3 s after other V4 kernel tests.)"""
    spec = _spec(v4_mtp, "triton")
    _check(spec, _pool(spec, 2), [STEP[4]], writes=("csa_kv", "csa_index_k", "swa_kv", "csa_stage", "hca_stage"))


def test_verify_step_is_capture_safe(v4_mtp, launches):
    spec = _spec(v4_mtp, "triton", k=1)
    pool = _pool(spec, 3)
    graphs = SpecGraphs(spec, pool.page_size, pool.num_pages, 8, capture=False)
    graphs.states = pool.all_states
    g = graphs.verify
    traces = []
    for reqs in (ONE, TWO):
        hb = widened(_batch(reqs), g.width)
        bs = bucket_for(hb.seq_lens.shape[0], g.buckets)
        g.inputs.load(pad_extend(hb, bs, 2))
        launches.clear()
        with count_host_syncs() as syncs, Trace() as trace:
            out = g.run_forward(g.inputs.view(bs), bs)
        assert syncs == [], "\n".join(syncs)
        assert out.shape[0] == bs * 2
        traces.append(trace.events + list(launches))
    one, two = traces
    assert len(one) == len(two)
    for i, (x, y) in enumerate(zip(one, two)):
        assert x == y, f"dispatch {i} differs between two verify steps of one bucket: {x} vs {y}"
    assert any(e[0] == "launch" and "attn" in e[1] for e in one), "the extend attention kernel ran"
    assert any(e[0] == "launch" and "indexer" in e[1] for e in one), "the indexer kernel ran"
    layers = spec.runner.cfg.num_hidden_layers
    print(f"V4 verify dispatches: {len(one)} in {layers} layers ({sum(e[0] == 'launch' for e in one)} launches)")
    assert len(one) / layers <= V4_VERIFY_DISPATCHES_PER_LAYER


# ---- the MTP block's catch-up over the positions a verify made valid (1..k+1 a request) -------


def _catch_up(spec, pool, reqs, graphs):
    """(logits, streams) of each request's last row, from the MTP block over reqs' rows."""
    hb = _batch(reqs)
    T = hb.input_ids.shape[0]
    cfg = spec.runner.cfg
    prev = torch.linspace(-1, 1, T * cfg.hc_mult * cfg.hidden_size).view(T, cfg.hc_mult, -1)
    spec.graphs = graphs
    try:
        return spec._mtp_forward(hb, False, pool, prev)
    finally:
        spec.graphs = None


def test_fixed_catch_up_equals_the_eager_one(v4_mtp):
    """5 requests of 1..4 positions in bucket 8 through the catch-up's static buffers (padding
    tokens, padding requests) against the eager MTP forward: logits, streams, the block's ring."""
    spec = _spec(v4_mtp, "torch")
    pool = _pool(spec, 5)
    graphs = SpecGraphs(spec, pool.page_size, pool.num_pages, 8, capture=False)
    used = []
    step = graphs.catch_up.step
    graphs.catch_up.step = lambda h: (used.append(1), step(h))[1]
    snapshot = {k: v.clone() for k, v in pool.all_states.items()}
    eager = [t.clone() for t in _catch_up(spec, pool, STEP, None)]
    after_eager = {k: v.clone() for k, v in pool.all_states.items()}
    _restore(pool, snapshot)
    static = [t.clone() for t in _catch_up(spec, pool, STEP, graphs)]
    assert used == [1]
    tol = reorder_tol(spec.runner)
    for a, b in zip(static, eager, strict=True):
        assert a.shape[0] == len(STEP)
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    ring = spec.mtp_ring
    assert not torch.equal(after_eager[ring], snapshot[ring])
    for k, v in pool.all_states.items():
        assert_same_writes(v, snapshot[k], after_eager[k], tol, k)


def test_catch_up_step_is_capture_safe(v4_mtp, launches):
    spec = _spec(v4_mtp, "triton", k=1)
    pool = _pool(spec, 6)
    graphs = SpecGraphs(spec, pool.page_size, pool.num_pages, 8, capture=False)
    graphs.states = pool.all_states
    g = graphs.catch_up
    traces = []
    for reqs in (ONE, TWO):
        hb = widened(_batch(reqs), g.width)
        bs = bucket_for(hb.seq_lens.shape[0], g.buckets)
        g.inputs.load(pad_extend(hb, bs, 2))
        graphs.prev_ext.normal_()
        launches.clear()
        with count_host_syncs() as syncs, Trace() as trace:
            out = g.run_forward(g.inputs.view(bs), bs)
        assert syncs == [], "\n".join(syncs)
        assert out.shape[0] == bs * 2
        traces.append(trace.events + list(launches))
    one, two = traces
    assert len(one) == len(two) and any(e[0] == "launch" for e in one)
    for i, (x, y) in enumerate(zip(one, two)):
        assert x == y, f"dispatch {i} differs between two catch-ups of one bucket: {x} vs {y}"
