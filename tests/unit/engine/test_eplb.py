"""EPLB's placement (dsv4_engine.parallel.eplb): pure functions of recorded loads."""

from __future__ import annotations

import random

import pytest

from dsv4_engine.parallel import eplb


def skewed(n: int, seed: int, alpha: float = 1.2) -> list[float]:
    """Zipf-like loads in a shuffled expert order: a few hot experts, a long cold tail."""
    rng = random.Random(seed)
    loads = [1000.0 / (k + 1) ** alpha for k in range(n)]
    rng.shuffle(loads)
    return loads


def test_replicas_go_to_the_highest_load_per_copy():
    # 100 needs two copies (50 each) before 60 gets its second; ties go to the lower id
    assert eplb.replicas([100, 60, 10, 10], 2) == [2, 2, 1, 1]  # 100 -> 50 per copy < 60: then 60
    assert eplb.replicas([100, 10, 10, 10], 2) == [3, 1, 1, 1]
    assert eplb.replicas([5, 5, 5, 5], 1) == [2, 1, 1, 1]
    assert sum(eplb.replicas(skewed(32, 0), 8)) == 40


def test_pack_fills_every_rank_slots_and_never_doubles_an_expert_on_a_rank():
    loads = skewed(32, 1)
    copies = eplb.replicas(loads, 8)
    caps = eplb.slot_counts(32, 8, 8)
    assert caps == [5] * 8  # 4 base experts + one redundant each
    ranks = eplb.pack(loads, copies, caps)
    assert [len(r) for r in ranks] == caps
    assert all(len(set(r)) == len(r) for r in ranks)
    placed = sorted(e for r in ranks for e in r)
    assert placed == sorted(e for e in range(32) for _ in range(copies[e]))


def test_pack_refuses_slots_that_do_not_match():
    with pytest.raises(ValueError):
        eplb.pack([1.0, 1.0], [1, 1], [1, 2])


@pytest.mark.parametrize("seed", range(5))
def test_one_redundant_expert_per_rank_balances_skewed_loads_to_within_ten_percent(seed):
    loads = skewed(64, seed)
    slots = eplb.place_layer(loads, 8, 8)
    before = eplb.imbalance(eplb.rank_loads(loads, eplb.block_layer(64, 8), 8))
    after = eplb.imbalance(eplb.rank_loads(loads, slots, 8))
    assert before > 1.3, before  # the skew is real
    assert after <= 1.10, (before, after)


def test_rank_loads_split_a_replicated_expert_evenly():
    # expert 0 (load 8) on both ranks: 4 each; ranks hold slots [0, 1] and [0, 2]
    assert eplb.rank_loads([8, 2, 2], (0, 1, 0, 2), 2) == [6.0, 6.0]


def test_uniform_loads_stay_balanced_and_the_placement_is_deterministic():
    loads = [1.0] * 32
    a, b = eplb.place_layer(loads, 4, 4), eplb.place_layer(loads, 4, 4)
    assert a == b
    assert eplb.imbalance(eplb.rank_loads(loads, a, 4)) == pytest.approx(1.0, abs=0.04)


def test_refusals():
    assert eplb.eplb_refusal(32, 9, 8) is not None  # more than one per rank
    assert eplb.eplb_refusal(32, -1, 8) is not None
    assert eplb.eplb_refusal(32, 8, 8) is None
    assert eplb.ep_flags_refusal(1, None, 1, speculative=True) is not None
    assert eplb.ep_flags_refusal(0, "loads.json", 2, speculative=False) is not None
    assert eplb.ep_flags_refusal(2, None, 2, speculative=False) is None


def test_checkpoints_whose_experts_cannot_be_placed_are_refused():
    from dsv4_engine.checkpoint import PRESETS

    assert eplb.ep_checkpoint_refusal(PRESETS["moe32"], 2) is None
    assert eplb.ep_checkpoint_refusal(PRESETS["moe32"], 0) is None
    assert eplb.ep_checkpoint_refusal(PRESETS["v4-moe32"], 2) is None  # V4: learned and hash-routed layers
    assert "model_type" in eplb.ep_checkpoint_refusal({**PRESETS["moe32"], "model_type": "llama"}, 1)
    fp8 = {**PRESETS["moe32"], "quantization_config": {"quant_method": "fp8"}}
    assert "quantized" in eplb.ep_checkpoint_refusal(fp8, 1)


def test_plan_report_and_json_round_trip():
    loads = {1: skewed(32, 3), 2: skewed(32, 4)}
    p = eplb.plan(loads, 4, 4)
    assert eplb.Placement.from_json(p.to_json()) == p
    assert p.rank_block(0) == (0, 9) and p.rank_block(3) == (27, 36)
    rep = eplb.report(loads, p)
    assert set(rep["layers"]) == {"1", "2"}
    assert rep["worst"]["eplb"] < rep["worst"]["block"]
    with pytest.raises(ValueError):
        eplb.plan({1: [1.0] * 32, 2: [1.0] * 16}, 1, 2)
