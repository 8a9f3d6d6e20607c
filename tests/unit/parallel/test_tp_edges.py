"""--tp-size edges: every size the startup check lets through splits every tensor of the
checkpoint on every rank (no refusal deep inside a rank), sizes it cannot split are refused in
one line before any rank starts, and odd sizes (3 ranks over 4 experts, a rank per expert) give
tp 1's greedy tokens."""

from __future__ import annotations

import pytest

from dsv4_engine.checkpoint import PRESETS, quantization_config, tensor_shapes, v4_tensor_shapes
from dsv4_engine.config import ModelConfig
from dsv4_engine.models.deepseek_v4_config import DeepseekV4Config
from dsv4_engine.parallel.plan import Shard, block, plan_for, tp_refusal

TINY = PRESETS["tiny"]
VARIANTS = {
    "tiny": TINY,
    "mla512": PRESETS["mla512"],
    "tiny-fp8": {**TINY, "quantization_config": quantization_config(TINY, "fp8")},
    "mla512-fp8": {**PRESETS["mla512"], "quantization_config": quantization_config(PRESETS["mla512"], "fp8")},
    # dense layers from moe_layer_freq, not first_k_dense_replace (DeepSeek-V2 style)
    "freq2": {**TINY, "first_k_dense_replace": 0, "moe_layer_freq": 2, "intermediate_size": 510},
    "all-dense": {**TINY, "first_k_dense_replace": 0, "n_routed_experts": 0, "intermediate_size": 510},
    "odd-experts": {**TINY, "n_routed_experts": 6, "n_group": 1, "moe_intermediate_size": 96},
    "no-q-lora": {**TINY, "q_lora_rank": None},
}


def _split_everything(model_type: str, config: dict, size: int) -> None:
    """Run the plan of every rank over every tensor (and fp8 scale) of the checkpoint."""
    plan = plan_for(model_type)
    cfg = (DeepseekV4Config if model_type == "deepseek_v4" else ModelConfig).from_dict(config)
    shapes = (v4_tensor_shapes if model_type == "deepseek_v4" else tensor_shapes)(config)
    quantized = "quantization_config" in config
    for r in range(size):
        shard = Shard(r, size)
        slicer = plan.slicer(cfg, shard)
        local = plan.local_config(cfg, shard)
        assert local.n_routed_experts == block(cfg.n_routed_experts, shard)[1] - block(cfg.n_routed_experts, shard)[0]
        for name, shape in shapes.items():
            slicer(name, shape)
            if quantized and name.endswith(".weight") and len(shape) == 2:
                slicer(name.removesuffix(".weight") + ".weight_scale_inv", (-(-shape[0] // 128), -(-shape[1] // 128)))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_size_the_startup_check_accepts_splits_every_tensor(variant):
    config = VARIANTS[variant]
    cfg = ModelConfig.from_dict(config)
    for size in range(1, 10):
        why = tp_refusal("deepseek_v3", cfg, size)
        if why is None:
            _split_everything("deepseek_v3", config, size)
        else:
            assert why.startswith(f"--tp-size {size} ") and "\n" not in why


def test_v4_sizes_up_to_the_expert_count_split_and_beyond_are_refused():
    config = PRESETS["v4-tiny"]
    cfg = DeepseekV4Config.from_dict(config)
    for size in range(1, cfg.n_routed_experts + 1):
        assert tp_refusal("deepseek_v4", cfg, size) is None
        _split_everything("deepseek_v4", config, size)
    why = tp_refusal("deepseek_v4", cfg, cfg.n_routed_experts + 1)
    assert why == f"--tp-size {cfg.n_routed_experts + 1} is more than the routed experts ({cfg.n_routed_experts})"


@pytest.mark.parametrize("variant,size,named", [
    ("freq2", 4, "intermediate_size (510)"),
    ("all-dense", 4, "intermediate_size (510)"),
    ("tiny", 3, "num_attention_heads (8)"),
    ("tiny", 16, "num_attention_heads (8)"),
    ("tiny-fp8", 2, "off the 128x128 quantization blocks"),
])
def test_sizes_that_do_not_split_are_refused_naming_the_dimension(variant, size, named):
    why = tp_refusal("deepseek_v3", ModelConfig.from_dict(VARIANTS[variant]), size)
    assert why is not None and named in why


def test_every_scale_spelling_the_loader_pairs_is_split_with_its_weight():
    """pair_quantized reads `<module>.scale` as well as `.weight_scale_inv`, and fused experts'
    `..._scale_inv`: each must follow its weight's split, or rank 1 pairs a half weight with
    whole scales and fails deep in its load."""
    from dsv4_engine.parallel.plan import expert_slice, v3_slicer

    cfg = ModelConfig.from_dict(VARIANTS["mla512-fp8"])
    s1 = v3_slicer(cfg, Shard(1, 2))
    assert s1("model.layers.0.self_attn.q_b_proj.scale", (8, 1)) == ("model.layers.0.self_attn.q_b_proj.scale",
                                                                     (slice(4, 8),))
    assert s1("model.layers.0.self_attn.o_proj.scale", (4, 4))[1] == (slice(None), slice(2, 4))
    assert s1("model.layers.0.self_attn.kv_a_proj_with_mqa.scale", (5, 4))[1] == ()
    # transformers' stacked experts [E, ...] and their stacked scales: the same block of experts
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.gate_up_proj_scale_inv",
                 "model.layers.1.mlp.experts.down_proj_scale_inv", "layers.2.ffn.experts.down_proj_scale_inv"):
        assert expert_slice(name, (8, 4, 4), 4, 8) == (name, (slice(4, 8),)), name
