"""Capture safety of the decode forward, checked on CPU (the Triton backend under the
interpreter, the path a GPU captures): two decode steps of different content padded to one
bucket issue the same ops with the same shapes and the same kernel launches, read nothing back
to the host, and stay within the per-layer dispatch budget. The padded, static-buffer step
gives the same logits as the plain one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from host_sync_probe import count_host_syncs, from_interpreter
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4_engine.cuda_graphs import (
    DECODE_DISPATCHES_PER_LAYER,
    V4_DECODE_DISPATCHES_PER_LAYER,
    bucket_for,
    graph_buckets,
    pad_decode,
)
from dsv4_engine.kv_cache import KVPool
from dsv4_engine.model_runner import ModelRunner
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.scheduler import ScheduledSeq
from dsv4_engine.sequence import Sequence


def test_buckets():
    assert graph_buckets(0) == []
    assert graph_buckets(1) == [1]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(64)[-3:] == [48, 56, 64]
    b = graph_buckets(20)
    assert [bucket_for(n, b) for n in (1, 3, 5, 9, 17, 20, 21)] == [1, 4, 8, 16, 20, 20, None]


class Trace(TorchDispatchMode):
    """Every aten op with its output shapes and dtypes, and every Triton launch with its grid,
    tensor shapes and scalar arguments, in order."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if from_interpreter():  # Triton's interpreter running a kernel on CPU: a launch on a GPU
            return out
        outs = out if isinstance(out, (tuple, list)) else (out,)
        self.events.append(
            ("op", str(func), tuple((tuple(o.shape), o.dtype) for o in outs if isinstance(o, torch.Tensor)))
        )
        return out


# On a GPU these tests run the compiled kernels on CUDA; here, the interpreter on CPU.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def launches(monkeypatch):
    if DEVICE.type == "cuda":
        from triton.runtime.jit import JITFunction as InterpretedFunction
    else:
        from triton.runtime.interpreter import InterpretedFunction

    events: list[tuple] = []
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        desc = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)
        events.append(("launch", self.fn.__name__, grid, desc, tuple(sorted(kwargs.items()))))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    return events


@pytest.fixture(scope="module")
def runner(tiny_model):
    return ModelRunner(tiny_model, "float32", str(DEVICE), "triton")


def _decoding(rid: str, prompt: list[int], out: list[int], pages: list[int]) -> ScheduledSeq:
    s = Sequence(rid, prompt, SamplingParams(max_tokens=64, temperature=0))
    s.output_ids = out
    s.num_computed = len(prompt) + len(out) - 1
    s.pages = pages
    return ScheduledSeq(s, 1)


def _step_trace(runner, pool, graphs, batch, launches):
    """What a graph captures: the forward over the static buffers, once they hold the step."""
    hb = runner.host_batch(batch, pool.page_size, graphs.width)
    runner._states = pool.all_states
    bs = bucket_for(len(batch), graphs.buckets)
    graphs.inputs.load(pad_decode(hb, bs))
    launches.clear()
    with count_host_syncs() as syncs, Trace() as trace:
        logits = graphs.run_forward(graphs.inputs.view(bs), bs)
    return logits[: len(batch)], trace.events + list(launches), syncs


def reorder_tol(runner) -> float:
    """How far two float32 runs of one step may differ when only the GEMMs' blocking differs (a
    4-row batch and a 3-row one pick other BLAS kernels on some CPUs): a K-term float32 sum is
    within K * 2**-24 of exact relative to its terms' magnitudes (order one here), so two
    orderings within twice that, per layer (K = the hidden size, the longest reduction)."""
    return 2 * runner.cfg.hidden_size * 2.0**-24 * runner.cfg.num_hidden_layers


def assert_same_writes(
    after: torch.Tensor, before: torch.Tensor, want: torch.Tensor, tol: float, msg: str = ""
) -> None:
    """`after` changed exactly the elements the plain step changed (`before` -> `want`): every
    other element is bit for bit as it was, the written ones are within the float32 bound."""
    written = want != before
    assert torch.equal(after[~written], before[~written]), f"{msg}: the padded step wrote where the plain one did not"
    torch.testing.assert_close(after[written], want[written], atol=tol, rtol=tol, msg=msg)


def assert_same_capture(runner, pool, graphs, one, two, launches, budget: int) -> None:
    """Decode batches `one` (3 requests) and `two` (4), both padded to bucket 4: no host read in
    either, the same dispatches (ops, shapes, launches) in both, within `budget` a layer."""
    assert bucket_for(len(one), graphs.buckets) == bucket_for(len(two), graphs.buckets) == 4
    logits1, trace1, syncs1 = _step_trace(runner, pool, graphs, one, launches)
    logits2, trace2, syncs2 = _step_trace(runner, pool, graphs, two, launches)
    assert syncs1 == [] and syncs2 == [], "\n".join(syncs1 + syncs2)
    assert logits1.shape[0] == 3 and logits2.shape[0] == 4
    assert len(trace1) == len(trace2)
    for i, (x, y) in enumerate(zip(trace1, trace2)):
        assert x == y, f"dispatch {i} differs between two steps of one bucket: {x} vs {y}"
    per_layer = len(trace1) / runner.cfg.num_hidden_layers
    print(
        f"{runner.model_type} decode dispatches: {len(trace1)} in {runner.cfg.num_hidden_layers} layers "
        f"({sum(e[0] == 'launch' for e in trace1)} kernel launches)"
    )
    assert per_layer <= budget, f"{per_layer:.1f} dispatches a layer > budget {budget}"


def test_decode_step_is_capture_safe(runner, launches):
    torch.manual_seed(0)
    pool = KVPool(runner.state_specs, 16, 8, torch.float32, DEVICE)
    pool.states[runner.model.LATENT_KV].normal_()  # any cached content: the trace must not care
    graphs = runner.decode_graphs(pool.page_size, pool.num_pages, capture=False)
    assert graphs.width == 16  # fixed: the pool's pages (tiny's context is longer)
    one = [
        _decoding("a", [5, 6, 7], [8], [0]),
        _decoding("b", list(range(3, 20)), [4, 9], [1, 2, 3]),
        _decoding("f", [1, 2], [3], [11]),
    ]
    two = [
        _decoding("c", list(range(30, 60)), [2], [4, 5, 6, 7]),
        _decoding("d", [11], [12, 13, 14, 15, 16, 17, 18, 19, 20], [8, 9]),
        _decoding("e", [21, 22], [23], [10]),
        _decoding("g", list(range(50, 90)), [1], [12, 13, 14, 15, 0, 1]),
    ]
    assert_same_capture(runner, pool, graphs, one, two, launches, DECODE_DISPATCHES_PER_LAYER)


def test_padded_static_step_gives_the_plain_steps_logits(runner):
    pool = KVPool(runner.state_specs, 16, 8, torch.float32, DEVICE)
    torch.manual_seed(1)
    pool.states[runner.model.LATENT_KV].normal_()
    batch = [
        _decoding("a", [5, 6, 7], [8], [0]),
        _decoding("b", list(range(3, 20)), [4, 9], [1, 2, 3]),
        _decoding("c", [40, 41], [42], [5]),
    ]
    snapshot = pool.states[runner.model.LATENT_KV].clone()
    plain = runner.model.forward(runner.build_batch(batch, pool.page_size), pool.all_states)
    after_plain = pool.states[runner.model.LATENT_KV].clone()
    pool.states[runner.model.LATENT_KV].copy_(snapshot)
    graphs = runner.decode_graphs(pool.page_size, pool.num_pages, capture=False)
    runner._states = pool.all_states
    padded = graphs.step(runner.host_batch(batch, pool.page_size, graphs.width))  # 3 rows in bucket 4
    tol = reorder_tol(runner)
    torch.testing.assert_close(padded, plain, atol=tol, rtol=tol)
    # The padding row wrote only what row 0 writes: the cache is as the plain step left it.
    assert_same_writes(pool.states[runner.model.LATENT_KV], snapshot, after_plain, tol, "latent")


def test_pad_decode_repeats_the_first_row():
    from dsv4_engine.batch_buffers import host_batch

    hb = host_batch([3, 5], [1, 1], [[2], [0, 1]], [[7], [9]], [None, None], 4, width=6)
    p = pad_decode(hb, 4)
    assert p.block_table.shape == (4, 6)
    assert p.slot_mapping.tolist() == [11, 5, 11, 11] and p.input_ids.tolist() == [7, 9, 7, 7]
    assert np.array_equal(p.logits_indices, np.arange(4))


def test_graphs_are_off_on_cpu(tiny_model):
    r = ModelRunner(tiny_model, "float32", "cpu", "torch", cuda_graph_max_bs=16)
    assert r.cuda_graph_max_bs == 0 and not r.graphs_supported()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU to capture")
def test_captured_graphs_replay_the_eager_decode(tiny_model):
    r = ModelRunner(tiny_model, "float32", "cuda", "triton", cuda_graph_max_bs=8)
    assert r.cuda_graph_max_bs == 8
    pool = KVPool(r.state_specs, 16, 8, torch.float32, DEVICE)
    assert r.capture_graphs(pool)  # at start-up, on the fresh pool: every bucket
    assert sorted(r.graphs.graphs) == r.graphs.buckets
    torch.manual_seed(2)
    pool.states[r.model.LATENT_KV].normal_()
    for batch in (
        [_decoding("a", [5, 6, 7], [8], [0]), _decoding("b", list(range(3, 20)), [4, 9], [1, 2, 3])],
        [
            _decoding("c", [40, 41], [42], [5]),
            _decoding("d", [1] * 30, [2], [6, 7, 8, 9]),
            _decoding("e", [3], [4], [10]),
        ],
    ):
        snapshot = pool.states[r.model.LATENT_KV].clone()
        eager = r.model.forward(r.build_batch(batch, pool.page_size), pool.all_states).clone()
        pool.states[r.model.LATENT_KV].copy_(snapshot)
        replayed = r.forward(batch, pool).clone()  # replays the captured graph
        torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)


# ---- DeepSeek-V4: a captured decode step closes compression windows masked ------------------
# v4-tiny: window 8, CSA every 4 tokens, HCA every 8. A decode token at position t closes a CSA
# window when (t + 1) % 4 == 0 and an HCA one when (t + 1) % 8 == 0; the eager step closes only
# those rows, the captured one runs the close for every row and keeps what the others held.


@pytest.fixture(scope="module")
def v4_runner(make_model):
    return ModelRunner(make_model("v4-tiny"), "float32", str(DEVICE), "triton")


def _v4_decoding(rid: str, prompt: list[int], out: list[int], pages: list[int], slot: int) -> ScheduledSeq:
    s = _decoding(rid, prompt, out, pages)
    s.seq.slot = slot
    return s


def _v4_pool(runner, seed: int) -> KVPool:
    pool = KVPool(runner.state_specs, 16, 8, torch.float32, DEVICE, max_num_seqs=6)
    torch.manual_seed(seed)
    for t in pool.all_states.values():  # any content: the trace must not care, the close must keep it
        t.normal_()
    return pool


def test_v4_decode_step_is_capture_safe(v4_runner, launches):
    pool = _v4_pool(v4_runner, 3)
    graphs = v4_runner.decode_graphs(pool.page_size, pool.num_pages, capture=False)
    # positions 7 (closes CSA and HCA), 5 (none), 11 (CSA) / 4, 9, 14, 2 (none close)
    one = [
        _v4_decoding("a", list(range(3, 10)), [4], [0], 0),
        _v4_decoding("b", [5, 6, 7], [8, 9, 1], [1], 1),
        _v4_decoding("c", list(range(20, 30)), [2, 3], [2, 3], 2),
    ]
    two = [
        _v4_decoding("d", [1, 2, 3, 4], [5], [4], 3),
        _v4_decoding("e", list(range(40, 48)), [6, 7], [5, 6], 4),
        _v4_decoding("f", list(range(60, 75)), [1], [7, 8], 5),
        _v4_decoding("g", [9, 8], [7], [9], 0),
    ]
    assert_same_capture(v4_runner, pool, graphs, one, two, launches, V4_DECODE_DISPATCHES_PER_LAYER)


def test_v4_padded_static_step_gives_the_plain_steps_logits_and_states(v4_runner):
    """The masked close of the captured step equals the eager step's closing of just the rows
    that close: same logits, every state tensor the same afterwards (rows that close nothing
    and the padding row leave their stores as they were)."""
    pool = _v4_pool(v4_runner, 4)
    batch = [
        _v4_decoding("a", list(range(3, 10)), [4], [0], 0),
        _v4_decoding("b", [5, 6, 7], [8, 9, 1], [1], 1),
        _v4_decoding("c", list(range(20, 30)), [2, 3], [2, 3], 2),
    ]  # positions 7, 5, 11
    snapshot = {k: v.clone() for k, v in pool.all_states.items()}
    plain = v4_runner.model.forward(v4_runner.build_batch(batch, pool.page_size), pool.all_states)
    after_plain = {k: v.clone() for k, v in pool.all_states.items()}
    for k, v in pool.all_states.items():
        v.copy_(snapshot[k])
    graphs = v4_runner.decode_graphs(pool.page_size, pool.num_pages, capture=False)
    v4_runner._states = pool.all_states
    padded = graphs.step(v4_runner.host_batch(batch, pool.page_size, graphs.width))  # 3 rows in bucket 4
    tol = reorder_tol(v4_runner)
    torch.testing.assert_close(padded, plain, atol=tol, rtol=tol)
    for k, v in pool.all_states.items():
        assert_same_writes(v, snapshot[k], after_plain[k], tol, k)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU to capture")
def test_v4_captured_graphs_replay_the_eager_decode(make_model):
    r = ModelRunner(make_model("v4-tiny"), "float32", "cuda", "triton", cuda_graph_max_bs=8)
    assert r.cuda_graph_max_bs == 8
    pool = KVPool(r.state_specs, 16, 8, torch.float32, DEVICE, max_num_seqs=6)
    assert r.capture_graphs(pool)  # at start-up, on the fresh pool: every bucket
    torch.manual_seed(5)
    for t in pool.all_states.values():
        t.normal_()
    for batch in (
        [_v4_decoding("a", list(range(3, 10)), [4], [0], 0), _v4_decoding("b", [5, 6, 7], [8, 9, 1], [1], 1)],
        [
            _v4_decoding("c", list(range(20, 30)), [2, 3], [2, 3], 2),
            _v4_decoding("d", [1, 2, 3, 4], [5], [4], 3),
            _v4_decoding("e", list(range(40, 48)), [6, 7], [5, 6], 4),
        ],
    ):
        snapshot = {k: v.clone() for k, v in pool.all_states.items()}
        eager = r.model.forward(r.build_batch(batch, pool.page_size), pool.all_states).clone()
        for k, v in pool.all_states.items():
            v.copy_(snapshot[k])
        replayed = r.forward(batch, pool).clone()  # replays the captured graph
        torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)
