"""Sharding plans are pure: every rank's slices of every tensor, put back together, are the
whole checkpoint exactly once (shapes only, no I/O)."""

from __future__ import annotations

import pytest
import torch

from dsv4_engine.checkpoint import PRESETS, tensor_shapes
from dsv4_engine.config import ModelConfig
from dsv4_engine.parallel.plan import Shard, block, expert_slice, tp_refusal, v3_local_config, v3_slicer


def test_blocks_cover_everything_once_and_as_evenly_as_possible():
    for total in (1, 4, 7, 256):
        for size in range(1, min(total, 6) + 1):
            spans = [block(total, Shard(r, size)) for r in range(size)]
            assert spans[0][0] == 0 and spans[-1][1] == total
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            assert max(h - l for l, h in spans) - min(h - l for l, h in spans) <= 1


def test_a_shard_outside_the_world_is_refused():
    with pytest.raises(ValueError):
        Shard(2, 2)


@pytest.mark.parametrize("preset", ["tiny", "mla512"])
@pytest.mark.parametrize("size", [2, 4])
def test_v3_slices_reassemble_every_tensor(preset, size):
    cfg_d = PRESETS[preset]
    cfg = ModelConfig.from_dict(cfg_d)
    shapes = tensor_shapes(cfg_d)
    # Number every element, slice per rank, and check each element lands exactly once (sharded
    # tensors) or on every rank (replicated ones).
    seen: dict[str, torch.Tensor] = {n: torch.zeros(s, dtype=torch.int32) for n, s in shapes.items()}
    kept_by: dict[str, set[int]] = {}
    for r in range(size):
        slicer = v3_slicer(cfg, Shard(r, size))
        for name, shape in shapes.items():
            got = slicer(name, shape)
            if got is None:
                continue
            local, index = got
            kept_by.setdefault(name, set()).add(r)
            view = seen[name][index] if index else seen[name]
            view += 1
            if ".experts." in name and "shared" not in name:
                e = int(name.split(".experts.")[1].split(".")[0])
                lo, _ = block(cfg.n_routed_experts, Shard(r, size))
                assert local == name.replace(f".experts.{e}.", f".experts.{e - lo}.")
    for name, counts in seen.items():
        split = any(
            k in name for k in ("q_b_proj", "q_proj", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        )
        if split:
            assert torch.all(counts == 1), name  # split by rows/columns or owned by one rank
        else:
            assert torch.all(counts == size), name  # replicated
    # The router (gate) and the latent projection stay whole on every rank.
    assert kept_by["model.layers.1.mlp.gate.weight"] == set(range(size))
    assert kept_by["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == set(range(size))


def test_v3_local_config_has_this_ranks_heads_width_and_experts():
    cfg = ModelConfig.from_dict(PRESETS["tiny"])
    local = v3_local_config(cfg, Shard(1, 2))
    assert local.num_attention_heads == cfg.num_attention_heads // 2
    assert local.intermediate_size == cfg.intermediate_size // 2
    lo, hi = block(cfg.n_routed_experts, Shard(1, 2))
    assert local.n_routed_experts == hi - lo
    assert local.kv_lora_rank == cfg.kv_lora_rank and local.moe_intermediate_size == cfg.moe_intermediate_size


def test_fused_experts_are_sliced_by_their_leading_dim_and_other_tensors_are_no_experts():
    assert expert_slice("model.layers.1.mlp.experts.gate_up_proj", (8, 4, 2), 2, 4) == (
        "model.layers.1.mlp.experts.gate_up_proj",
        (slice(2, 4),),
    )
    assert expert_slice("layers.1.ffn.experts.5.w1", (4, 2), 4, 8) == ("layers.1.ffn.experts.1.w1", ())
    assert expert_slice("layers.1.ffn.experts.3.w1", (4, 2), 4, 8) is None
    assert expert_slice("layers.1.ffn.shared_experts.w1", (4, 2), 0, 1) is False


def test_refusals_say_which_dimension_does_not_split():
    cfg = ModelConfig.from_dict(PRESETS["tiny"])
    assert tp_refusal("deepseek_v3", cfg, 1) is None
    assert tp_refusal("deepseek_v3", cfg, 2) is None
    assert "num_attention_heads" in tp_refusal("deepseek_v3", cfg, 3)
    assert "at least 1" in tp_refusal("deepseek_v3", cfg, 0)
    assert "not supported" in tp_refusal("llama", cfg, 2)


def test_v4_splits_experts_and_attention_heads_and_keeps_the_rest():
    from dsv4_engine.parallel.plan import v4_local_config, v4_slicer
    from dsv4_engine.models.deepseek_v4_config import DeepseekV4Config

    cfg = DeepseekV4Config.from_dict(PRESETS["v4-tiny"])
    s0, s1 = v4_slicer(cfg, Shard(0, 2)), v4_slicer(cfg, Shard(1, 2))
    # query heads and output groups split (issue 49); the one KV head, compressors, indexer whole
    half_q = cfg.num_attention_heads // 2 * cfg.head_dim
    assert s0("layers.0.attn.wq_b.weight", (4, 4)) == ("layers.0.attn.wq_b.weight", (slice(0, half_q),))
    assert s1("layers.0.attn.wq_b.weight", (4, 4)) == ("layers.0.attn.wq_b.weight", (slice(half_q, 2 * half_q),))
    assert s1("layers.0.attn.wkv.weight", (4, 4)) == ("layers.0.attn.wkv.weight", ())
    assert s1("layers.0.attn.indexer.wq_b.weight", (4, 4)) == ("layers.0.attn.indexer.wq_b.weight", ())
    assert v4_local_config(cfg, Shard(1, 2)).num_attention_heads == cfg.num_attention_heads // 2
    assert s0("layers.0.ffn.shared_experts.w1.weight", (4, 4)) == ("layers.0.ffn.shared_experts.w1.weight", ())
    assert s0("layers.0.ffn.experts.3.w1.weight", (4, 4)) is None
    assert s1("layers.0.ffn.experts.3.w1.weight", (4, 4)) == ("layers.0.ffn.experts.1.w1.weight", ())
    assert v4_local_config(cfg, Shard(1, 2)).n_routed_experts == cfg.n_routed_experts // 2
    assert tp_refusal("deepseek_v4", cfg, cfg.n_routed_experts + 1) is not None


def test_fp8_block_scales_follow_their_weights_split():
    d = {**PRESETS["mla512"], "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    cfg = ModelConfig.from_dict(d)
    s1 = v3_slicer(cfg, Shard(1, 2))
    # q_b: 8 heads of 128 rows -> rank 1 holds rows 512..1024, scale rows 4..8.
    assert s1("model.layers.0.self_attn.q_b_proj.weight", (1024, 128)) == (
        "model.layers.0.self_attn.q_b_proj.weight",
        (slice(512, 1024),),
    )
    assert s1("model.layers.0.self_attn.q_b_proj.weight_scale_inv", (8, 1)) == (
        "model.layers.0.self_attn.q_b_proj.weight_scale_inv",
        (slice(4, 8),),
    )
    # o_proj splits columns: its scale splits columns too.
    assert s1("model.layers.0.self_attn.o_proj.weight_scale_inv", (4, 4)) == (
        "model.layers.0.self_attn.o_proj.weight_scale_inv",
        (slice(None), slice(2, 4)),
    )
    # A replicated weight keeps its whole scale; a split off the block grid is refused.
    assert s1("model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv", (5, 4))[1] == ()
    with pytest.raises(ValueError, match="quantization blocks"):
        v3_slicer(cfg, Shard(1, 8))("model.layers.0.self_attn.o_proj.weight_scale_inv", (4, 4))  # 64 columns a rank
    assert "quantization blocks" in tp_refusal("deepseek_v3", cfg, 4)  # kv_b: 2 heads x 128 rows, o: 2 x 64 columns
    assert tp_refusal("deepseek_v3", cfg, 2) is None
