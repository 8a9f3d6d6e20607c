"""DeepSeek-V4 presets and config parsing, checked against transformers' own reading of them."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys

import pytest
import torch

from dsv4_engine.checkpoint import PRESETS, V4_PRESETS, init_checkpoint, v4_tensor_shapes
from dsv4_engine.models.deepseek_v4 import DeepseekV4
from dsv4_engine.models.deepseek_v4_config import CSA, HCA, SLIDING, DeepseekV4Config
from dsv4_engine.models.deepseek_v4_weights import load_v4_weights, release_name, to_release_layout
from dsv4_engine.weights import load_weights

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV4Config as HFConfig  # noqa: E402
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding  # noqa: E402


def _digest(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return init_checkpoint(tmp_path_factory.mktemp("v4") / "tiny", preset="v4-tiny", seed=0)


def _hf_config(d: dict) -> HFConfig:
    return HFConfig(**{k: v for k, v in d.items() if k not in ("model_type", "architectures")})


def _assert_same_as_transformers(ours: DeepseekV4Config, theirs) -> None:
    assert ours.layer_types == list(theirs.layer_types)
    assert ours.mlp_layer_types == list(theirs.mlp_layer_types)
    assert ours.compress_rates == dict(theirs.compress_rates)
    assert ours.qk_rope_head_dim == theirs.qk_rope_head_dim
    rot = DeepseekV4RotaryEmbedding(theirs)
    assert torch.equal(ours.rope_main.inv_freq(), rot.main_inv_freq)
    assert torch.equal(ours.rope_compress.inv_freq(), rot.compress_inv_freq)
    assert rot.main_attention_scaling == 1.0 and rot.compress_attention_scaling == 1.0


@pytest.mark.parametrize("preset", sorted(V4_PRESETS))
def test_preset_config_reads_as_transformers_reads_it(preset):
    d = json.loads(json.dumps(PRESETS[preset]))
    ours = DeepseekV4Config.from_dict(d)
    _assert_same_as_transformers(ours, _hf_config(d))
    assert set(ours.layer_types) == {SLIDING, CSA, HCA}  # every attention path present
    assert set(ours.mlp_layer_types) == {"hash_moe", "moe"}


def test_legacy_flat_config_forms():
    """compress_ratios / compress_rate_* / num_hash_layers / qk_rope_head_dim / rope_scaling, and a
    flat rope_parameters, resolve as in transformers; the nested form is taken as given."""
    base = {
        k: v
        for k, v in PRESETS["v4-tiny"].items()
        if k not in ("layer_types", "mlp_layer_types", "compress_rates", "rope_parameters", "partial_rotary_factor")
    }
    legacy = {
        **base,
        "compress_ratios": [0, 4, 128, 4],
        "compress_rate_csa": 4,
        "compress_rate_hca": 128,
        "num_hash_layers": 1,
        "qk_rope_head_dim": 16,
        "rope_scaling": {
            "type": "yarn",
            "factor": 8,
            "original_max_position_embeddings": 128,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    }
    flat_params = {
        **base,
        "compress_ratios": [4, 0, 4, 128],
        "qk_rope_head_dim": 16,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 2.0,
            "original_max_position_embeddings": 512,
        },
    }
    plain = {**base, "qk_rope_head_dim": 8}  # no layer types at all: transformers' default schedule
    for d in (legacy, flat_params, plain):
        ours = DeepseekV4Config.from_dict(json.loads(json.dumps(d)))
        _assert_same_as_transformers(ours, _hf_config(json.loads(json.dumps(d))))
    assert DeepseekV4Config.from_dict(legacy).mlp_layer_types == ["hash_moe", "moe", "moe", "moe"]
    with pytest.raises(ValueError, match="compress_ratios"):
        DeepseekV4Config.from_dict({**base, "compress_ratios": [0, 8, 0, 0]})
    with pytest.raises(ValueError, match="layer_types"):
        DeepseekV4Config.from_dict({**PRESETS["v4-tiny"], "layer_types": ["sliding_attention"] * 3})


def test_v4_tiny_is_deterministic_per_seed(tmp_path, tiny_dir):
    """Same seed, same bytes, also through `dsv4 model init` in another process."""
    again = tmp_path / "again"
    subprocess.run(
        [sys.executable, "-m", "dsv4_cli", "model", "init", str(again), "--preset", "v4-tiny", "--seed", "0"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    other = init_checkpoint(tmp_path / "other", preset="v4-tiny", seed=1)
    assert _digest(again) == _digest(tiny_dir)
    assert _digest(other)["model.safetensors"] != _digest(tiny_dir)["model.safetensors"]
    assert _digest(other)["tokenizer.json"] == _digest(tiny_dir)["tokenizer.json"]


def test_v4_tiny_is_in_the_release_layout_and_transformers_loads_it_whole(tiny_dir):
    from safetensors import safe_open

    with safe_open(str(tiny_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == set(v4_tensor_shapes(PRESETS["v4-tiny"]))
    for n in (
        "embed.weight",
        "head.weight",
        "hc_head_fn",
        "layers.0.attn.wq_a.weight",
        "layers.1.attn.indexer.wq_b.weight",
        "layers.1.attn.indexer.compressor.ape",
        "layers.2.attn.compressor.wgate.weight",
        "layers.0.ffn.gate.tid2eid",
        "layers.3.ffn.gate.bias",
        "layers.3.ffn.experts.3.w2.weight",
    ):
        assert n in names
    model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        str(tiny_dir), dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # every tensor used, none missing
    sd = model.state_dict()
    ours = load_v4_weights(tiny_dir)
    # the loaded tid2eid table is the one we wrote, and the fused experts are w1|w3 per expert
    assert torch.equal(sd["model.layers.0.mlp.gate.tid2eid"], ours["layers.0.ffn.gate.tid2eid"].long())
    assert torch.equal(
        sd["model.layers.3.mlp.experts.gate_up_proj"][2],
        torch.cat([ours["layers.3.ffn.experts.2.w1.weight"], ours["layers.3.ffn.experts.2.w3.weight"]]),
    )


def test_save_pretrained_and_native_layouts_load_to_the_release_tensors(tmp_path, tiny_dir):
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    model.save_pretrained(tmp_path / "hf")
    release = load_v4_weights(tiny_dir)
    saved = load_v4_weights(tmp_path / "hf")
    native = to_release_layout({k: v for k, v in model.state_dict().items()})
    for other in (saved, native):
        assert set(other) == set(release)
        for k, v in release.items():
            assert torch.equal(other[k].to(v.dtype), v), k
    assert (
        release_name("model.layers.1.self_attn.compressor.indexer.kv_norm.weight")
        == "layers.1.attn.indexer.compressor.norm.weight"
    )


def test_mtp_tensors_are_skipped(tmp_path, tiny_dir):
    from safetensors.torch import load_file, save_file

    w = load_file(str(tiny_dir / "model.safetensors"))
    w["mtp.0.attn.wq_a.weight"] = torch.zeros(3, 3)
    save_file(w, str(tmp_path / "model.safetensors"))
    loaded = load_v4_weights(tmp_path)
    assert not any("mtp" in k for k in loaded) and len(loaded) == len(w) - 1
    assert "mtp.0.attn.wq_a.weight" not in load_weights(tmp_path)  # the engine's generic reader too


def test_flash_shape_has_v4_flash_widths_and_fits_here():
    cfg = DeepseekV4Config.from_dict(PRESETS["v4-flash-shape"])
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim) == (4096, 64, 512, 64)
    assert (cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank) == (1024, 8, 1024)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, cfg.sliding_window) == (64, 128, 512, 128)
    assert cfg.compress_rates == {CSA: 4, HCA: 128}
    shapes = v4_tensor_shapes(PRESETS["v4-flash-shape"])
    assert shapes["layers.0.attn.wq_b.weight"] == (64 * 512, 1024)
    assert shapes["layers.0.attn.wo_a.weight"] == (8 * 1024, 64 * 512 // 8)
    params = sum(math.prod(s) for s in shapes.values())
    assert params * 2 < 1.0e9  # stored in bf16: under 1 GB on disk


def test_v4_state_specs_of_flash_shape():
    specs = {s.name: s for s in DeepseekV4.state_specs(DeepseekV4Config.from_dict(PRESETS["v4-flash-shape"]))}
    assert specs["swa_kv"].kind == "slot" and specs["swa_kv"].slot_shape() == (3, 128, 512)
    assert specs["csa_kv"].tokens_per_entry == 4 and specs["hca_kv"].tokens_per_entry == 128
    assert specs["csa_kv"].bytes_per_token(torch.bfloat16) == 512 * 2 / 4
    assert specs["csa_stage"].slot_shape() == (1, 8, 2048) and specs["hca_stage"].slot_shape() == (1, 128, 1024)
    # HCA windows (128) span 8 pages of 16 tokens: the entry lives in its window's first page
    assert specs["hca_kv"].entries_per_page(16) == 1 and specs["hca_kv"].entry_location(3, 16) == (24, 0)
    assert specs["csa_kv"].entries_per_page(16) == 4 and specs["csa_kv"].entry_location(5, 16) == (1, 1)
    with pytest.raises(ValueError, match="divide"):
        specs["hca_kv"].entries_per_page(48)


def test_registry_serves_v4_checkpoints(tiny_dir):
    from dsv4_engine.models import entry_for_dir

    entry = entry_for_dir(tiny_dir)
    assert entry.model_class() is DeepseekV4
    assert entry.config_class().from_dir(tiny_dir).layer_types == PRESETS["v4-tiny"]["layer_types"]


def test_quantized_tensors_are_refused_not_misread(tiny_dir):
    cfg = DeepseekV4Config.from_dir(tiny_dir)
    w = load_v4_weights(tiny_dir)
    w["layers.0.attn.wq_a.weight"] = w["layers.0.attn.wq_a.weight"].to(torch.float8_e4m3fn)
    # fp8 with its scales loads (tests/unit/quant); without them it is refused, never cast
    with pytest.raises(ValueError, match="without its scales"):
        DeepseekV4(cfg, w)


def test_default_page_size_fills_compressed_pages():
    """Without --page-size a page is 16 tokens, or the longest compression window when longer:
    V4-Flash's HCA keeps one entry per 128 tokens, and in 16-token pages it would pay for 8
    entry slots per window and fill one (64 B/token instead of 8 in bf16)."""
    from dsv4_engine.kv_cache import default_page_size
    from dsv4_engine.models.state import StateSpec

    v3 = [StateSpec("latent_kv", 2, (576,))]
    v4_flash = [
        StateSpec("csa_kv", 1, (512,), tokens_per_entry=4),
        StateSpec("hca_kv", 1, (512,), tokens_per_entry=128),
        StateSpec("swa_kv", 1, (512,), kind="slot", slots=128),
    ]
    v4_tiny = [StateSpec("csa_kv", 1, (64,), tokens_per_entry=4), StateSpec("hca_kv", 1, (64,), tokens_per_entry=8)]
    assert default_page_size(v3) == 16 and default_page_size(v4_tiny) == 16
    assert default_page_size(v4_flash) == 128
    hca = v4_flash[1]
    assert hca.page_nbytes(16, torch.bfloat16) / 16 == 64 and hca.page_nbytes(128, torch.bfloat16) / 128 == 8
