"""Data-parallel attention (`--tp-size 2 --dp-size 2`, rank 1 a real child process, gloo on
127.0.0.1) with the engine's other features on: FP8 KV, EPLB, speculative decoding and (stood in
on the CPU) CUDA graphs. Each equals `--tp-size 1` with the same feature, greedy, with the staggered
arrivals and the abort of test_dp_engine (one rank idles in the first steps)."""

from __future__ import annotations

import json

import pytest
import torch
from test_dp_engine import bounded, one_thread, staggered  # noqa: F401 (fixture)
from test_tp_spec_decode import ABORT, drive, mtp_models, requests  # noqa: F401 (fixture)
from cpu_graphs import read_log
from test_tp_spec_graphs import cpu_graphs, events  # noqa: F401 (fixture)

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.parallel import eplb
from dsv4_engine.parallel.dp_graphs import dp_graphs_refusal, padded_step_ids
from dsv4_engine.parallel.dp_spec import rank_major_rows
from dsv4_engine.parallel.eplb_apply import rebalance


GRAPH_MAX_BS = 2  # buckets 1, 2 requests a rank


def engine(model_dir, tp: int, dp: int = 1, kv_pages: int = 10, **kw) -> Engine:
    return Engine(
        EngineArgs(
            model=str(model_dir),
            device="cpu",
            kernel_backend="cpu",
            kv_pages=kv_pages,
            page_size=8,
            max_num_batched_tokens=16,
            tp_size=tp,
            dp_size=dp,
            enable_prefix_cache=False,
            **kw,
        )
    )


def spec_engine(model_dir, tp: int, spec: bool, graphs: int = 0, kv: str = "auto") -> Engine:
    """As test_tp_spec_decode's engines, at --dp-size tp."""
    kw = dict(speculative_algorithm="mtp", speculative_num_steps=3) if spec else {}
    return Engine(
        EngineArgs(
            model=str(model_dir),
            device="cpu",
            kernel_backend="cpu",
            kv_pages=24,
            page_size=8,
            max_num_batched_tokens=24,
            enable_prefix_cache=False,
            tp_size=tp,
            dp_size=tp,
            cuda_graph_max_bs=graphs,
            kv_cache_dtype=kv,
            **kw,
        )
    )


def run_dp(model_dir, **kw) -> dict:
    e = engine(model_dir, 2, 2, **kw)
    try:
        return bounded(lambda: staggered(e))
    finally:
        e.tp.close()


@pytest.mark.parametrize("preset", ["tiny", pytest.param("v4-tiny", marks=pytest.mark.slow)])
def test_dp2_with_fp8_kv_equals_tp1_with_fp8_kv(make_model, preset):
    model = make_model(preset)
    ref_engine = engine(model, 1, kv_pages=20, kv_cache_dtype="fp8_e4m3")
    assert torch.uint8 in {t.dtype for t in ref_engine.pool.all_states.values()}  # packed FP8 + scale
    ref = staggered(ref_engine)
    got = run_dp(model, kv_cache_dtype="fp8_e4m3")
    assert got["tokens"] == ref["tokens"] and got["reasons"] == ref["reasons"]


@pytest.mark.slow
def test_dp2_with_eplb_places_replicas_from_recorded_loads_and_keeps_the_output(make_model, tmp_path):
    """moe32 (32 routed experts, learned routing): loads recorded by a `--tp-size 1` run place one
    redundant expert per rank; the output is unchanged, by that placement and by a rebalance from
    the live loads mid-run; every token is counted once (each rank routes the gathered tokens)."""
    model = make_model("moe32")
    ref_engine = engine(model, 1, kv_pages=20)
    ref = staggered(ref_engine)
    recorded = ref_engine.runner.eplb.table()
    loads_file = tmp_path / "loads.json"
    loads_file.write_text(json.dumps(recorded))
    e = engine(model, 2, 2, ep_redundant_experts=2, ep_loads_file=str(loads_file))
    placer = e.runner.eplb
    reports = [eplb.report(placer.planned_from, placer.placement)]

    def watch(step):
        if step == 6:  # between two steps, as POST /admin/eplb/rebalance does
            reports.append(rebalance(placer, e.tp)["report"])

    try:
        got = bounded(lambda: staggered(e, watch=watch))
        counted = placer.table()
    finally:
        e.tp.close()
    assert got["tokens"] == ref["tokens"] and got["reasons"] == ref["reasons"]
    assert placer.placement.ranks == 2 and placer.placement.redundant == 2
    for i, row in recorded["layers"].items():
        assert counted["layers"][i]["experts"] == row["experts"], f"layer {i}: each token counted once"
    for rep in reports:
        assert rep["worst"]["eplb"] <= 1.10 < rep["worst"]["block"], rep
    print(
        "max/mean load per rank (worst layer): "
        + "; ".join(f"block {r['worst']['block']}, eplb {r['worst']['eplb']}" for r in reports)
    )


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_dp2_speculation_equals_tp1_plain_decoding_and_drafts_as_one_rank(mtp_models, kv):
    """MTP under DP: rank 0 verifies, both ranks run the target and the MTP block over their own
    requests (each rank's MTP KV in its own pool), the MoE over both. Drafts steered right, wrong
    or half right, an abort mid-way (test_tp_spec_decode.drive); the drafter's own drafts equal a
    one-rank speculating engine's."""
    torch.manual_seed(0)
    model = mtp_models("tiny")
    reqs = requests(1)
    plain, _ = drive(spec_engine(model, 1, False, kv=kv), reqs)
    ref, ref_drafts = drive(spec_engine(model, 1, True, kv=kv), reqs, plain)
    e = spec_engine(model, 2, True, kv=kv)
    try:
        got, got_drafts = bounded(lambda: drive(e, reqs, plain))
        assert e.tp.failed is None
        t = e.metrics.totals
        assert 0 < t["spec_decode_num_accepted_tokens"] < t["spec_decode_num_draft_tokens"]
        assert e.pool.allocator.held_per_rank() == [0, 0]  # every page back, on both ranks
    finally:
        e.tp.close()
    toks, reason = got.pop(ABORT[0])
    assert reason == "abort" and 0 < len(toks) < len(plain[ABORT[0]][0]) and toks == plain[ABORT[0]][0][: len(toks)]
    assert got == {rid: (v[0], "length") for rid, v in plain.items() if rid != ABORT[0]}
    assert got_drafts == ref_drafts and len(got_drafts) > 10
    assert ref.pop(ABORT[0])[0] == toks and ref == got


def test_rank_major_rows_order_the_rows_as_the_shares_concatenate():
    # r0 (3 rows) on rank 1, r1 (1) on rank 0, r2 (2) on rank 1; rank 2 has none
    assert rank_major_rows([3, 1, 2], [1, 0, 1], 3).tolist() == [3, 0, 1, 2, 4, 5]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "v4-tiny"])
def test_dp2_with_each_rank_replaying_its_own_graphs_equals_tp1(make_model, cpu_graphs, preset):
    """CUDA graphs stood in on the CPU (cpu_graphs.py) on both ranks: each captures its own
    data-parallel decode step per bucket at start-up; a decode step replays on every rank with
    requests the bucket of the largest share (a rank with fewer pads to it; one with none runs
    only the MoE's collectives; V4: every rank's token ids padded as the rows). Greedy tokens
    equal --tp-size 1 without graphs."""
    log0, log1, _ = cpu_graphs
    model = make_model(preset)
    ref = staggered(engine(model, 1, kv_pages=20, cuda_graph_max_bs=0))
    e = engine(model, 2, 2, cuda_graph_max_bs=GRAPH_MAX_BS)
    shares: list[list[int]] = []
    try:
        status = e.loads()["cuda_graphs"]
        assert status["enabled"] and status["batch_sizes"] == [1, 2], status
        got = bounded(
            lambda: staggered(e, watch=lambda s: shares.append([r["running"] for r in e.loads()["dp_ranks"]]))
        )
    finally:
        e.tp.close()
    assert all(p.poll() == 0 for p in e.tp.procs)
    assert got["tokens"] == ref["tokens"] and got["reasons"] == ref["reasons"]
    name = "data-parallel decode"
    assert events(log0, "capture") == events(log1, "capture") == [f"capture {name} {b}" for b in (2, 1)]
    replays = events(log0, "replay"), events(log1, "replay")
    assert all(replays), "both ranks replayed their own graphs"
    assert [1, 2] in shares or [2, 1] in shares, shares  # a step whose shares differ: both replay bucket 2
    assert f"replay {name} 2" in replays[0] and f"replay {name} 2" in replays[1], replays
    assert replays[0].count(f"replay {name} 1") > replays[1].count(f"replay {name} 1"), "rank 1 idles at first"
    print(f"shares per step {shares}; rank 0 replays {len(replays[0])}, rank 1 {len(replays[1])}")


def test_per_rank_graphs_are_captured_for_v3_and_v4():
    assert dp_graphs_refusal("deepseek_v3") is None and dp_graphs_refusal("deepseek_v4") is None
    assert "--dp-size" in dp_graphs_refusal("llama")


def test_a_v4_graph_step_reads_every_ranks_token_ids_padded_as_its_rows():
    # rank 0: two rows, rank 1 idle, rank 2 one row; bucket 3
    ids = padded_step_ids([torch.tensor([5, 6]), None, torch.tensor([9])], 3)
    assert ids.tolist() == [5, 6, 5, 0, 0, 0, 9, 9, 9]


@pytest.mark.slow
def test_dp2_speculation_with_each_rank_replaying_its_own_graphs_equals_tp1(mtp_models, cpu_graphs):
    """MTP and graphs (stood in on the CPU) under DP: both ranks capture the verify and draft
    sets over their own pools; captured steps replay on each rank with rows the bucket of the
    step's largest share. Tokens equal tp 1 plain; drafts equal a one-rank speculating engine's."""
    torch.manual_seed(0)
    log0, log1, _ = cpu_graphs
    model = mtp_models("tiny")
    reqs = requests(1)
    plain, _ = drive(spec_engine(model, 1, False, graphs=0), reqs)
    ref, ref_drafts = drive(spec_engine(model, 1, True, graphs=0), reqs, plain)
    since = len(read_log(log0))
    e = spec_engine(model, 2, True, graphs=GRAPH_MAX_BS)
    try:
        status = e.loads()["cuda_graphs"]
        assert status["enabled"] and status["eager_reason"] is None, status
        got, got_drafts = bounded(lambda: drive(e, reqs, plain))
        assert e.tp.failed is None
    finally:
        e.tp.close()
    assert all(p.poll() == 0 for p in e.tp.procs)
    captured = events(log0, "capture", since)
    sets = {"speculative verify", "speculative draft"}
    assert {x.rsplit(" ", 1)[0].removeprefix("capture ") for x in captured} == sets
    assert captured == events(log1, "capture")
    replays = events(log0, "replay", since), events(log1, "replay")
    for r in replays:
        assert {x.rsplit(" ", 1)[0].removeprefix("replay ") for x in r} == sets, replays
    assert got == ref and got_drafts == ref_drafts and len(got_drafts) > 10
    toks, reason = got.pop(ABORT[0])
    assert reason == "abort" and toks == plain[ABORT[0]][0][: len(toks)]
    assert got == {rid: (v[0], "length") for rid, v in plain.items() if rid != ABORT[0]}
