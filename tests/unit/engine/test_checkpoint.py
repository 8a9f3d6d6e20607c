"""`dsv4 model init` checkpoints, checked against transformers' DeepseekV3ForCausalLM (fp32): the
tensor layout of real DeepSeek-V3 files, a clean load, determinism, and greedy decoding without
near-ties."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dsv4_engine.checkpoint import PRESETS, init_checkpoint
from dsv4_engine.config import ModelConfig
from dsv4_engine.tokenizer import BOS_TOKEN, EOS_TOKEN, Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["tiny", "mla512"])
def ckpt(request, tiny_model, mla512_model):
    return {"tiny": tiny_model, "mla512": mla512_model}[request.param]


@pytest.fixture(scope="module")
def hf_model(ckpt):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, output_loading_info=True)
    return model.eval(), info


def _read_config(ckpt) -> dict:
    return json.loads((ckpt / "config.json").read_text())


def test_config_has_the_deepseek_v3_fields(ckpt):
    c = _read_config(ckpt)
    assert c["model_type"] == "deepseek_v3" and c["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (c["topk_method"], c["scoring_func"], c["norm_topk_prob"]) == ("noaux_tc", "sigmoid", True)
    assert c["n_routed_experts"] == 8 and c["num_experts_per_tok"] == 2 and c["n_shared_experts"] == 1
    assert (c["n_group"], c["topk_group"], c["first_k_dense_replace"]) == (2, 1, 1)
    assert c["routed_scaling_factor"] > 1 and c["torch_dtype"] == "float32"
    tok = Tokenizer.from_dir(ckpt)
    assert c["bos_token_id"] == tok.bos_id and [c["eos_token_id"]] == tok.eos_ids
    assert tok.vocab_size <= c["vocab_size"]
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (tok.bos_id, tok.eos_ids[0])
    cfg = ModelConfig.from_dir(ckpt)  # the engine's reader takes it
    assert cfg.is_moe_layer(1) and not cfg.is_moe_layer(0)


def test_mla512_has_the_real_latent_width_and_yarn(mla512_model):
    c = _read_config(mla512_model)
    assert (c["kv_lora_rank"], c["qk_rope_head_dim"]) == (512, 64)
    assert c["rope_scaling"]["type"] == "yarn"
    assert (
        c["rope_scaling"]["factor"]
        == c["max_position_embeddings"] / c["rope_scaling"]["original_max_position_embeddings"]
    )
    assert PRESETS["tiny"]["rope_scaling"] is None  # tiny keeps plain rope: both paths get tested


def test_tensors_named_and_shaped_as_transformers_saves_them(ckpt, tmp_path):
    """transformers' own save_pretrained writes per-expert names, as DeepSeek's releases do:
    our file must have exactly those names and shapes."""
    c = _read_config(ckpt)
    hf_cfg = transformers.DeepseekV3Config(**{k: v for k, v in c.items() if k not in ("model_type", "architectures")})
    transformers.DeepseekV3ForCausalLM(hf_cfg).save_pretrained(tmp_path)

    def shapes(path):
        with safe_open(str(path), "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}

    ours = shapes(ckpt / "model.safetensors")
    assert ours == shapes(tmp_path / "model.safetensors")
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in ours
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in ours
    assert "model.layers.0.mlp.gate_proj.weight" in ours and "model.layers.0.mlp.gate.weight" not in ours
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}


def test_transformers_loads_every_weight_unchanged(ckpt, hf_model):
    model, info = hf_model
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"))
    ours = load_file(str(ckpt / "model.safetensors"))
    state = model.state_dict()
    # transformers fuses the experts of a layer into 3-D tensors; fuse ours the same way to compare.
    expected = {k: v for k, v in ours.items() if ".mlp.experts." not in k}
    n_experts = model.config.n_routed_experts
    for i in range(model.config.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        if p + "0.gate_proj.weight" in ours:
            expected[p + "gate_up_proj"] = torch.stack(
                [
                    torch.cat([ours[p + f"{j}.gate_proj.weight"], ours[p + f"{j}.up_proj.weight"]])
                    for j in range(n_experts)
                ]
            )
            expected[p + "down_proj"] = torch.stack([ours[p + f"{j}.down_proj.weight"] for j in range(n_experts)])
    assert set(expected) == set(state)
    for k, v in state.items():
        assert torch.equal(v, expected[k]), k
    if _read_config(ckpt)["rope_scaling"]:
        assert model.config.rope_parameters["rope_type"] == "yarn"


def test_init_statistics(tiny_model):
    w = load_file(str(tiny_model / "model.safetensors"))
    bias = w["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.abs().min() > 0 and bias.abs().max() < 0.5
    norm = w["model.layers.2.post_attention_layernorm.weight"]
    assert (norm - 1).abs().mean() < 0.2 and norm.std() > 0.01
    for name, t in w.items():
        assert torch.isfinite(t).all(), name


def test_greedy_decoding_has_clear_margins(ckpt, hf_model):
    """64 greedy steps on a few prompts: logits finite and bounded, top-1 never a near tie with
    top-2 (so an engine within 1e-4 of the oracle picks the same tokens), output not one token."""
    model, _ = hf_model
    tok = Tokenizer.from_dir(ckpt)
    min_gap = float("inf")
    for prompt in ["The weather today is", "def add(a, b):", "今天天气很好 😊"]:
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=64,
                min_new_tokens=64,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        logits = torch.stack(out.logits, 1)[0]
        assert torch.isfinite(logits).all() and logits.abs().max() < 100
        top2 = logits.topk(2, dim=-1).values
        min_gap = min(min_gap, (top2[:, 0] - top2[:, 1]).min().item())
        generated = out.sequences[0, ids.shape[1] :].tolist()
        assert len(set(generated)) >= 8, generated
    print(f"min top-1/top-2 gap over 3x64 greedy steps: {min_gap:.4f}")
    assert min_gap > 1e-3


def test_same_seed_same_bytes_also_in_another_process(tiny_model, tmp_path):
    init_checkpoint(tmp_path / "a", preset="tiny", seed=0)
    subprocess.run(
        [sys.executable, "-m", "dsv4_cli", "model", "init", str(tmp_path / "b"), "--preset", "tiny", "--seed", "0"],
        check=True,
        capture_output=True,
    )
    init_checkpoint(tmp_path / "c", preset="tiny", seed=1)
    for name in FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tiny_model / name).read_bytes(), name
        assert (tmp_path / "b" / name).read_bytes() == (tiny_model / name).read_bytes(), name
    assert (tmp_path / "c" / "model.safetensors").read_bytes() != (tiny_model / "model.safetensors").read_bytes()
    assert (tmp_path / "c" / "tokenizer.json").read_bytes() == (tiny_model / "tokenizer.json").read_bytes()
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(FILES)  # no temporaries left


def test_unknown_preset_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown preset"):
        init_checkpoint(tmp_path, preset="huge")
    assert not any(tmp_path.iterdir())


def test_tokenizer_files_name_the_special_tokens(tiny_model):
    cfg = json.loads((tiny_model / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"]) == (BOS_TOKEN, EOS_TOKEN)
    assert "<｜User｜>" in cfg["chat_template"] and "<｜Assistant｜>" in cfg["chat_template"]


def test_num_layers_writes_a_deeper_model_the_engine_runs(tmp_path):
    """`dsv4 model init --num-layers N` (a deeper tiny model, where one MTP layer costs a realistic
    share of a forward): config, tensors and the engine's model all have N layers, MTP block at N."""
    from dsv4_engine.model_runner import get_ops
    from dsv4_engine.models.deepseek_v3 import DeepseekV3
    from dsv4_engine.spec_decode.train import _hidden_and_logits
    from dsv4_engine.weights import load_weights

    out = tmp_path / "deep"
    subprocess.run(
        [sys.executable, "-m", "dsv4_cli", "model", "init", str(out), "--preset", "tiny", "--num-layers", "6", "--mtp"],
        check=True,
        capture_output=True,
    )
    c = _read_config(out)
    assert c["num_hidden_layers"] == 6 and c["num_nextn_predict_layers"] == 1
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        layers = {int(k.split(".")[2]) for k in f.keys() if k.startswith("model.layers.")}
    assert layers == set(range(7))  # 6 main layers + the MTP block as model.layers.6
    cfg = ModelConfig.from_dir(out)
    model = DeepseekV3(cfg, load_weights(out), get_ops("cpu"), torch.float32, torch.device("cpu"))
    assert cfg.num_hidden_layers == 6 and len(model.layers) == 6
    hidden, logits = _hidden_and_logits(model, list(range(5, 21)))
    assert torch.isfinite(logits).all() and logits.shape[0] == 16


@pytest.mark.parametrize("preset,n,match", [("tiny", 0, "at least 1"), ("v4-tiny", 0, "at least 1")])
def test_num_layers_is_validated(tmp_path, preset, n, match):
    with pytest.raises(ValueError, match=match):
        init_checkpoint(tmp_path, preset=preset, num_layers=n)
    assert not any(tmp_path.iterdir())
