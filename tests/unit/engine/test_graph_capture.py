"""Decode graphs are captured at start-up, every bucket or none, in a capture mode that lets
other threads use CUDA meanwhile; at --tp-size > 1 every rank captures together and all keep
their graphs or all drop them. Checked on CPU: the capture sequence with torch.cuda's graph API
recorded, and the agreement with a real second rank over gloo."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from dsv4_engine import cuda_graphs
from dsv4_engine.cuda_graphs import DecodeGraphs
from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.model_runner import ModelRunner
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence


def capturing_graphs(calls: list) -> DecodeGraphs:
    g = DecodeGraphs(
        lambda t, bs: calls.append(("forward", bs, int(t["seq_lens"][0]))) or torch.zeros(bs, 3),
        max_bs=16,
        width=4,
        device=torch.device("cpu"),
        capture=False,
    )
    g.capture = True  # what a CUDA device gets; the CUDA calls are recorded below
    g._synchronize = lambda: None
    return g


class FakeGraph:
    made: list["FakeGraph"] = []

    def __init__(self):
        self._pool = object()
        FakeGraph.made.append(self)

    def pool(self):
        return self._pool


@pytest.fixture
def cuda_recorded(monkeypatch):
    """torch.cuda's stream and graph calls, recorded instead of run."""
    calls: list = []

    class Stream:
        def __init__(self, *a, **kw):
            pass

        def wait_stream(self, other):
            pass

    FakeGraph.made = []
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())

    def graph(g, pool=None, **kw):
        calls.append(("capture", g, pool, kw))
        return contextlib.nullcontext()

    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    return calls


def test_every_bucket_is_captured_largest_first_thread_local_one_pool(cuda_recorded):
    calls = cuda_recorded
    g = capturing_graphs(calls)
    assert g.capture_all() is None
    forwards = [c[1] for c in calls if c[0] == "forward"]
    # Two eager warm-ups, then the capture, per bucket, largest first.
    assert forwards == [b for b in reversed(g.buckets) for _ in range(3)]
    assert all(c[2] == 1 for c in calls if c[0] == "forward"), "the warm-up batch decodes position 0 (seq_len 1)"
    captures = [c for c in calls if c[0] == "capture"]
    assert [c[3]["capture_error_mode"] for c in captures] == ["thread_local"] * len(g.buckets)
    assert captures[0][2] is None
    assert [c[2] for c in captures[1:]] == [m.pool() for m in FakeGraph.made[:-1]], "one memory pool for all"
    assert sorted(g.graphs) == g.buckets and g.captured


def test_a_failed_bucket_drops_every_graph_and_says_which(cuda_recorded):
    calls = cuda_recorded
    g = capturing_graphs(calls)
    real = g._capture_one

    def failing(bs):
        if bs == 4:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
        real(bs)

    g._capture_one = failing
    reason = g.capture_all()
    assert (
        reason
        == "capturing the decode graph of batch size 4 failed: RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
    )
    assert g.graphs == {} and g.outputs == {} and g.pool is None and not g.captured
    # Not captured: a decode of any size runs the same padded step eagerly, never a KeyError.
    hb = cuda_graphs.warmup_batch(4)
    assert g.step(hb).shape == (1, 3)


def test_the_runner_captures_on_demand_and_turns_graphs_off_in_one_line(tiny_model, monkeypatch, caplog):
    monkeypatch.setattr(ModelRunner, "graphs_supported", lambda self: True)
    runner = ModelRunner(tiny_model, "float32", "cpu", "torch", cuda_graph_max_bs=8)
    from dsv4_engine.kv_cache import KVPool

    pool = KVPool(runner.state_specs, 8, 8, torch.float32, runner.device)
    monkeypatch.setattr(
        DecodeGraphs, "capture_all", lambda self, agree=None: "capturing the decode graph of batch size 2 failed: X"
    )
    pool.states[runner.model.LATENT_KV].fill_(1.0)  # what a warm-up forward writes, zeroed again
    with caplog.at_level(logging.INFO, logger="dsv4_engine.model_runner"):
        assert runner.capture_graphs(pool) is False
    lines = [r.getMessage() for r in caplog.records if "CUDA graphs" in r.getMessage()]
    assert lines == ["CUDA graphs off, decodes run eagerly: capturing the decode graph of batch size 2 failed: X"]
    assert runner.graphs is None and runner.cuda_graph_max_bs == 0
    assert not pool.states[runner.model.LATENT_KV].any()


def test_the_engine_captures_at_start_up_before_any_request(tiny_model, monkeypatch):
    captured = []
    monkeypatch.setattr(ModelRunner, "graphs_supported", lambda self: True)
    monkeypatch.setattr(ModelRunner, "capture_graphs", lambda self, pool, agree=None: captured.append(pool) or True)
    e = Engine(
        EngineArgs(
            model=str(tiny_model), device="cpu", kernel_backend="cpu", kv_pages=16, page_size=8, cuda_graph_max_bs=8
        )
    )
    assert captured == [e.pool] and not e.seqs


def test_at_tp2_all_ranks_keep_their_graphs_or_none(tiny_model, monkeypatch, caplog):
    """Rank 0 (here) captures its first batch size; rank 1 (a real child process, CPU) cannot
    capture at all and votes no at that size. They agree over gloo to drop the graphs, rank 0
    says why in one line naming rank 1, and the group still serves in step."""
    monkeypatch.setattr(ModelRunner, "graphs_supported", lambda self: True)
    monkeypatch.setattr(DecodeGraphs, "capture_all", lambda self, agree: agree(None))  # one size, then the vote
    with caplog.at_level(logging.INFO):
        e = Engine(
            EngineArgs(
                model=str(tiny_model),
                device="cpu",
                kernel_backend="cpu",
                kv_pages=16,
                page_size=8,
                cuda_graph_max_bs=8,
                tp_size=2,
            )
        )
    try:
        assert e.runner.cuda_graph_max_bs == 0 and e.runner.graphs is None
        assert [r.getMessage() for r in caplog.records if "CUDA graphs off" in r.getMessage()] == [
            "CUDA graphs off, decodes run eagerly: rank 1: CUDA graphs off on this rank: need a CUDA device, the "
            "triton kernel backend and a capture-safe model"
        ]
        assert e.loads()["cuda_graphs"]["enabled"] is False
        outs = []
        e.submit(
            Sequence("a", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), sink=outs.append)
        )
        for _ in range(50):
            e.step()
            if outs and outs[-1].finished:
                break
        assert outs and outs[-1].finished and outs[-1].finish_reason == "length"
    finally:
        e.tp.close()
    assert all(p.poll() == 0 for p in e.tp.procs)
