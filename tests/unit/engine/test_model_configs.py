"""Model configs are parsed from their dataclasses' own fields and defaults: a default is written
once, and it is transformers' (the checkpoints' oracle) unless a comment says why not."""

from __future__ import annotations

from dataclasses import fields

import pytest

from dsv4_engine.config import ModelConfig
from dsv4_engine.models.deepseek_v4_config import _DERIVED, DeepseekV4Config

V4_DIFFERS = {
    "num_nextn_predict_layers",  # the engine reads no MTP layer yet: a config that is silent asks none
    "torch_dtype",  # transformers has none (None); the engine's checkpoints default to float32
}


def test_v4_defaults_are_transformers_defaults():
    from transformers import DeepseekV4Config as HF

    hf = HF()
    ours = DeepseekV4Config.from_dict({"model_type": "deepseek_v4"})
    for f in fields(DeepseekV4Config):
        if f.name in (*_DERIVED, "extra", *V4_DIFFERS) or not hasattr(hf, f.name):
            continue
        assert getattr(ours, f.name) == getattr(hf, f.name), f.name
    assert ours.max_position_embeddings == 1048576  # it drifted to 4096 in a second copy once
    assert ours.qk_rope_head_dim == ours.head_dim // 8 and len(ours.layer_types) == ours.num_hidden_layers


def test_v4_reads_every_plain_field_as_written():
    special = {"scoring_func": "sigmoid", "torch_dtype": "bfloat16", "tie_word_embeddings": True}
    for f in fields(DeepseekV4Config):
        if f.name in (*_DERIVED, "extra"):
            continue
        value = special.get(f.name, f.default * 2 if isinstance(f.default, (int, float)) else None)
        assert value is not None, f"no test value for {f.name}"
        cfg = DeepseekV4Config.from_dict({f.name: value})  # each field changed alone arrives changed
        assert getattr(cfg, f.name) == value != f.default or f.default == 0, f.name


def test_v4_null_means_not_set_and_numbers_are_coerced():
    cfg = DeepseekV4Config.from_dict(
        {"hidden_size": 512.0, "rms_norm_eps": "1e-5", "index_topk": None, "bos_token_id": None}
    )
    assert cfg.hidden_size == 512 and isinstance(cfg.hidden_size, int)
    assert cfg.rms_norm_eps == 1e-5 and cfg.index_topk == 512
    assert cfg.bos_token_id is None  # Optional: a null is a value


def test_v3_fields_come_from_the_dataclass():
    base = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
    }
    cfg = ModelConfig.from_dict(base)
    for f in fields(ModelConfig):
        if f.name not in base and f.name != "extra":
            assert getattr(cfg, f.name) == f.default, f.name
    assert cfg.q_lora_rank is None and cfg.n_group == 1 and cfg.first_k_dense_replace == 0
    assert ModelConfig.from_dict({**base, "q_lora_rank": None}).q_lora_rank is None
    cfg = ModelConfig.from_dict({**base, "rope_parameters": {"rope_theta": 5e4, "rope_type": "yarn", "factor": 4}})
    assert cfg.rope_theta == 5e4 and cfg.rope_scaling["factor"] == 4
    with pytest.raises(ValueError, match="kv_lora_rank"):
        ModelConfig.from_dict({k: v for k, v in base.items() if k != "kv_lora_rank"})
