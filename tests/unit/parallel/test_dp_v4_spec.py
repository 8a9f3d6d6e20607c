"""DeepSeek-V4's MTP under data-parallel attention (`--tp-size 2 --dp-size 2
--speculative-algorithm mtp`, rank 1 a real child process, gloo on 127.0.0.1): each rank runs
the target's layers and the MTP block over its own requests (rings, compressors and the block's
own ring in its own slot rows), the MoE over both ranks' rows. Greedy output equals `--tp-size 1`
with the same speculation, drafts steered right, wrong or half right so rejected drafts' ring
entries are put back on both ranks, and an abort mid-way (test_tp_spec_decode.drive)."""

from __future__ import annotations

import pytest
import torch
from test_dp_engine import bounded, one_thread  # noqa: F401 (fixture)
from test_dp_extras import spec_engine
from test_tp_spec_decode import ABORT, drive, mtp_models, requests  # noqa: F401 (fixture)
from test_tp_spec_graphs import cpu_graphs  # noqa: F401 (fixture)

from dsv4_engine.parallel import wire


@pytest.mark.slow
def test_v4_dp2_speculation_equals_tp1_speculation_with_drafts_on_both_ranks(mtp_models):
    torch.manual_seed(0)
    model = mtp_models("v4-tiny")
    reqs = requests(1)
    plain, _ = drive(spec_engine(model, 1, False), reqs)
    ref, ref_drafts = drive(spec_engine(model, 1, True), reqs, plain)
    e = spec_engine(model, 2, True)
    dp = e.spec.mtp.dp  # rank 0's side of the data-parallel forwards (parallel.dp_spec)
    shares, drafted_on = dp._shares, set()

    def watch(fb, op):  # which ranks ran an MTP forward over requests of their own
        fb0, tokens, ids, order = shares(fb, op)
        if op == wire.OP_DP_SPEC_MTP:
            drafted_on.update(r for r, n in enumerate(tokens) if n)
        return fb0, tokens, ids, order

    dp._shares = watch
    try:
        got, got_drafts = bounded(lambda: drive(e, reqs, plain))
        assert e.tp.failed is None
        t = e.metrics.totals
        assert 0 < t["spec_decode_num_accepted_tokens"] < t["spec_decode_num_draft_tokens"]
        assert e.pool.allocator.held_per_rank() == [0, 0]  # every page back, on both ranks
    finally:
        e.tp.close()
    assert drafted_on == {0, 1}
    toks, reason = got.pop(ABORT[0])
    assert reason == "abort" and 0 < len(toks) < len(plain[ABORT[0]][0]) and toks == plain[ABORT[0]][0][: len(toks)]
    assert got == {rid: (v[0], "length") for rid, v in plain.items() if rid != ABORT[0]}
    assert got_drafts == ref_drafts and len(got_drafts) > 10
    assert ref.pop(ABORT[0])[0] == toks and ref == got


@pytest.mark.slow
def test_v4_dp2_speculation_with_graphs_asked_runs_eagerly_and_says_why(mtp_models, cpu_graphs):
    """V4's speculative steps are not captured per rank yet: asked for graphs (stood in on the
    CPU), neither rank captures, /v1/loads names the reason, and the output is tp 1's."""
    from cpu_graphs import read_log

    torch.manual_seed(0)
    log0, log1, _ = cpu_graphs
    model = mtp_models("v4-tiny")
    reqs = requests(1)
    plain, _ = drive(spec_engine(model, 1, False), reqs)
    ref, ref_drafts = drive(spec_engine(model, 1, True), reqs, plain)
    since = len(read_log(log0))
    e = spec_engine(model, 2, True, graphs=2)
    try:
        status = e.loads()["cuda_graphs"]
        assert not status["enabled"] and "--dp-size" in status["eager_reason"], status
        got, got_drafts = bounded(lambda: drive(e, reqs, plain))
        assert e.tp.failed is None
    finally:
        e.tp.close()
    assert read_log(log0)[since:] == [] and read_log(log1) == []  # nothing captured or replayed
    assert got == ref and got_drafts == ref_drafts
