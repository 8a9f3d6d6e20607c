"""The speculator's captured steps at `--tp-size 2` (rank 0 here, rank 1 a real child process,
gloo on 127.0.0.1), with CUDA graphs stood in on the CPU (cpu_graphs.py: a bucket's replay
recomputes its static output from its static inputs, all-reduces included): every rank captures
the same sets over the same buckets at start-up and replays the same graph for every step rank 0
replays, in the same order; greedy tokens equal `--tp-size 1` with graphs and with speculation
off (drafts steered right, wrong or half right, an abort mid-way: test_tp_spec_decode.drive). A
capture failure on rank 1 ends capture on both ranks at that bucket, within a deadline, with one
line naming rank 1, and the engine serves eagerly."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch
from cpu_graphs import OOM, install, read_log
from test_tp_spec_decode import ABORT, drive, mtp_models, one_thread, requests  # noqa: F401 (fixtures)

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.parallel import ranks

RANK = Path(__file__).with_name("cpu_graph_rank.py")
MAX_BS = 4  # buckets 1, 2, 4 requests (V3: rows 1, 2, 4, 8, 16)
CAPTURE_DEADLINE_S = 90.0  # start-up with capture: ~5 s here; a rank left waiting would take 300 s


def make_engine(model, tp_size: int, spec: bool, graphs: int = MAX_BS) -> Engine:
    args = dict(
        model=str(model),
        device="cpu",
        kernel_backend="cpu",
        kv_pages=24,
        page_size=8,
        max_num_batched_tokens=24,
        enable_prefix_cache=False,
        cuda_graph_max_bs=graphs,
    )
    if spec:
        args.update(speculative_algorithm="mtp", speculative_num_steps=3)
    return Engine(EngineArgs(**args, tp_size=tp_size))


@pytest.fixture
def cpu_graphs(monkeypatch, tmp_path):
    """Graphs stood in on this process (rank 0) and on the ranks it spawns; returns
    (rank 0's log, rank 1's log, how to choose rank 1's injected failure)."""
    logs = tmp_path / "rank0.log", tmp_path / "rank1.log"
    install(monkeypatch.setattr, None, str(logs[0]))

    def rank1_fails(at: str) -> None:
        monkeypatch.setattr(ranks, "WORKER", (str(RANK), str(logs[1]), at))

    monkeypatch.setattr(ranks, "WORKER", (str(RANK), str(logs[1])))
    return logs[0], logs[1], rank1_fails


def events(path, kind: str, since: int = 0) -> list[str]:
    return [x for x in read_log(path)[since:] if x.startswith(kind)]


@pytest.mark.parametrize("preset", ["v4-tiny", pytest.param("tiny", marks=pytest.mark.slow)])
def test_every_rank_replays_the_speculative_graphs_and_tokens_equal_tp1(mtp_models, cpu_graphs, preset):
    torch.manual_seed(0)
    model = mtp_models(preset)
    log0, log1, _ = cpu_graphs
    reqs = requests(1)
    plain, _ = drive(make_engine(model, 1, False, graphs=0), reqs)  # speculation and graphs off
    one = make_engine(model, 1, True)
    assert one.loads()["cuda_graphs"]["enabled"]
    ref, ref_drafts = drive(one, reqs, plain)
    since = len(read_log(log0))
    e = make_engine(model, 2, True)
    try:
        status = e.loads()["cuda_graphs"]
        assert status["enabled"] and status["eager_reason"] is None, status
        got, got_drafts = drive(e, reqs, plain)
        assert e.tp.failed is None
    finally:
        e.tp.close()
    assert all(p.poll() == 0 for p in e.tp.procs), "rank 1 stops cleanly when told"
    # Both ranks captured every bucket of every set, and replayed the same graphs in the same order.
    sets = {"speculative verify", "speculative draft"} | ({"speculative catch-up"} if preset == "v4-tiny" else set())
    captured = events(log0, "capture", since)
    assert {x.rsplit(" ", 1)[0].removeprefix("capture ") for x in captured} == sets
    assert captured == events(log1, "capture") and len(captured) == len(sets) * len(status["batch_sizes"])
    replayed = events(log0, "replay", since)
    assert replayed == events(log1, "replay")
    assert {x.rsplit(" ", 1)[0].removeprefix("replay ") for x in replayed} == sets, "every set replayed"
    # Greedy tokens: tp 2 with graphs == tp 1 with graphs == speculation off (but the aborted request's tail).
    assert got == ref and got_drafts == ref_drafts and len(got_drafts) > 10
    toks, reason = got.pop(ABORT[0])
    assert reason == "abort" and toks == plain[ABORT[0]][0][: len(toks)]
    assert got == {rid: (v[0], "length") for rid, v in plain.items() if rid != ABORT[0]}


@pytest.mark.slow  # ~4 s; the agreement itself is tested by default in tests/unit/engine/test_capture_agreement.py
def test_a_capture_failure_on_one_rank_ends_capture_on_every_rank(mtp_models, cpu_graphs, caplog):
    """Rank 1's draft graph of batch size 2 fails to capture: both ranks stop at that bucket (rank 0
    captured it, neither goes on to the catch-up set), rank 0 says so in one line naming rank 1,
    within a deadline; the engine then runs its steps eagerly on both ranks, tokens unchanged."""
    model = mtp_models("v4-tiny")
    log0, log1, rank1_fails = cpu_graphs
    rank1_fails("speculative draft:2")
    made: list = []
    with caplog.at_level(logging.INFO):
        start = threading.Thread(target=lambda: made.append(make_engine(model, 2, True)), daemon=True)
        start.start()
        start.join(CAPTURE_DEADLINE_S)
        assert made, f"the engine did not start within {CAPTURE_DEADLINE_S:g} s (a rank left waiting in capture)"
    e = made[0]
    try:
        line = f"rank 1: capturing the speculative draft graph of batch size 2 failed: RuntimeError: {OOM}"
        assert [r.getMessage() for r in caplog.records if "CUDA graphs off" in r.getMessage()] == [
            f"CUDA graphs off: {line}"
        ]
        assert e.loads()["cuda_graphs"] == {"enabled": False, "batch_sizes": [], "eager_reason": line}
        assert e.spec.graphs is None
        verify = [f"capture speculative verify {bs}" for bs in (4, 2, 1)]
        assert events(log0, "capture") == verify + ["capture speculative draft 4", "capture speculative draft 2"]
        assert events(log1, "capture") == verify + ["capture speculative draft 4"]
        reqs = {rid: r for rid, r in requests(2).items() if rid in ("r0", "r1")}
        got, _ = drive(e, reqs)
        assert e.tp.failed is None
    finally:
        e.tp.close()
    assert events(log0, "replay") == [] and events(log1, "replay") == []
    plain, _ = drive(make_engine(model, 1, False, graphs=0), reqs)
    assert got == plain
