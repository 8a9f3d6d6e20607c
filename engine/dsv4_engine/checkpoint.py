"""Make DeepSeek-V3 checkpoints here, without downloading anything: `dsv4 model init`.

A checkpoint is a Hugging Face folder with the same file and tensor layout as a real DeepSeek-V3
release (per-expert weights, `e_score_correction_bias`, `kv_a_proj_with_mqa`, ...), random weights
from a seed, and a byte-level BPE tokenizer trained on the corpus shipped in `data/`. The same
preset and seed always give byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from dsv4_engine.tokenizer import BOS_TOKEN, CHAT_TEMPLATE, EOS_TOKEN, SPECIAL_TOKENS

if TYPE_CHECKING:
    import torch

TOKENIZER_VOCAB_SIZE = 512  # 256 bytes + 4 special tokens + 252 merges learned from the corpus

# Fields every preset shares, named as in DeepSeek-V3's config.json (small MoE: 8 experts, top-2).
_COMMON = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": TOKENIZER_VOCAB_SIZE,
    "hidden_act": "silu",
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 0,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,  # SPECIAL_TOKENS are trained first, so bos is id 0 and eos id 1
    "eos_token_id": 1,
    "torch_dtype": "float32",
    "use_cache": True,
    "initializer_range": 0.02,  # transformers' default for weights a file lacks; ours has them all
}

PRESETS: dict[str, dict] = {
    # Small enough for every test: ~3M parameters, 12 MB.
    "tiny": {
        **_COMMON,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "q_lora_rank": 64,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "max_position_embeddings": 2048,
        "rope_scaling": None,
    },
    # The real MLA latent width (kv_lora_rank 512 + rope 64 = 576 cached values per token and
    # layer) and YaRN rope scaling as DeepSeek-V3 writes it; the rest stays small (~18M parameters).
    "mla512": {
        **_COMMON,
        "hidden_size": 512,
        "intermediate_size": 1024,
        "moe_intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "q_lora_rank": 128,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "v_head_dim": 64,
        "max_position_embeddings": 4096,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    },
}

# Init scales. Linear weights get std 1/sqrt(fan_in), so activations keep unit size through every
# layer. The lm_head gets a larger one: logits with std ~LOGIT_STD leave greedy decoding clear
# top-1/top-2 gaps (transformers' 0.02 gives gaps of ~0.04, i.e. near ties that flip under
# rounding). The router likewise, so that expert choices are not near ties.
LOGIT_STD = 4.0
ROUTER_LOGIT_STD = 2.0
NORM_NOISE_STD = 0.1
SCORE_BIAS_STD = 0.05


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, named exactly as in DeepSeek-V3's safetensors files."""
    c = config
    h, heads = c["hidden_size"], c["num_attention_heads"]
    qk_head = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if c.get("q_lora_rank"):
            shapes[p + "self_attn.q_a_proj.weight"] = (c["q_lora_rank"], h)
            shapes[p + "self_attn.q_a_layernorm.weight"] = (c["q_lora_rank"],)
            shapes[p + "self_attn.q_b_proj.weight"] = (heads * qk_head, c["q_lora_rank"])
        else:
            shapes[p + "self_attn.q_proj.weight"] = (heads * qk_head, h)
        shapes[p + "self_attn.kv_a_proj_with_mqa.weight"] = (c["kv_lora_rank"] + c["qk_rope_head_dim"], h)
        shapes[p + "self_attn.kv_a_layernorm.weight"] = (c["kv_lora_rank"],)
        shapes[p + "self_attn.kv_b_proj.weight"] = (heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])
        shapes[p + "self_attn.o_proj.weight"] = (h, heads * c["v_head_dim"])
        moe = c["n_routed_experts"] > 0 and i >= c["first_k_dense_replace"] and i % c.get("moe_layer_freq", 1) == 0
        if moe:
            e, inter = c["n_routed_experts"], c["moe_intermediate_size"]
            shapes[p + "mlp.gate.weight"] = (e, h)
            shapes[p + "mlp.gate.e_score_correction_bias"] = (e,)
            for j in range(e):
                shapes[p + f"mlp.experts.{j}.gate_proj.weight"] = (inter, h)
                shapes[p + f"mlp.experts.{j}.up_proj.weight"] = (inter, h)
                shapes[p + f"mlp.experts.{j}.down_proj.weight"] = (h, inter)
            if c["n_shared_experts"]:
                shared = inter * c["n_shared_experts"]
                shapes[p + "mlp.shared_experts.gate_proj.weight"] = (shared, h)
                shapes[p + "mlp.shared_experts.up_proj.weight"] = (shared, h)
                shapes[p + "mlp.shared_experts.down_proj.weight"] = (h, shared)
        else:
            inter = c["intermediate_size"]
            shapes[p + "mlp.gate_proj.weight"] = (inter, h)
            shapes[p + "mlp.up_proj.weight"] = (inter, h)
            shapes[p + "mlp.down_proj.weight"] = (h, inter)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (c["vocab_size"], h)
    return shapes


def _mean_std(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    if name.endswith("norm.weight"):
        return 1.0, NORM_NOISE_STD
    if name.endswith("e_score_correction_bias"):
        return 0.0, SCORE_BIAS_STD
    if name == "model.embed_tokens.weight":
        return 0.0, 1.0
    fan_in = shape[1]
    if name == "lm_head.weight":
        return 0.0, LOGIT_STD / math.sqrt(fan_in)
    if name.endswith("mlp.gate.weight"):
        return 0.0, ROUTER_LOGIT_STD / math.sqrt(fan_in)
    return 0.0, 1.0 / math.sqrt(fan_in)


def _tensor_seed(seed: int, name: str) -> int:
    # One generator per tensor, keyed by name: a tensor's values do not depend on which other
    # tensors exist or in which order they are made.
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def init_weights(config: dict, seed: int = 0) -> dict[str, "torch.Tensor"]:
    import torch  # here, not at the top: reading PRESETS (e.g. `dsv4 model init --help`) stays fast

    weights = {}
    for name, shape in tensor_shapes(config).items():
        mean, std = _mean_std(name, shape)
        gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
        weights[name] = (torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean).contiguous()
    return weights


def corpus_lines() -> list[str]:
    text = resources.files("dsv4_engine").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def train_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE) -> BackendTokenizer:
    """A byte-level BPE learned from the shipped corpus (deterministic: same corpus, same merges).
    Byte-level means every string is encodable; the post-processor prepends bos, as DeepSeek's does."""
    tok = BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return tok


def tokenizer_config(model_max_length: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _json_bytes(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def init_checkpoint(out_dir: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Write a checkpoint of `preset` with weights from `seed` into out_dir and return its path.
    config.json is written last, so a folder that has one is complete."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    config = dict(PRESETS[preset])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").unlink(missing_ok=True)  # rewriting: the folder is incomplete until the end

    tok = train_tokenizer()
    assert tok.token_to_id(BOS_TOKEN) == config["bos_token_id"] and tok.token_to_id(EOS_TOKEN) == config["eos_token_id"]
    assert tok.get_vocab_size() <= config["vocab_size"]
    _write(out / "tokenizer.json", tok.to_str(pretty=True).encode("utf-8"))
    _write(out / "tokenizer_config.json", _json_bytes(tokenizer_config(config["max_position_embeddings"])))

    from safetensors.torch import save_file

    tmp = out / "model.safetensors.tmp"
    save_file(init_weights(config, seed), str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)  # safetensors creates it owner-only; the other files are world-readable too
    os.replace(tmp, out / "model.safetensors")

    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"], "do_sample": False}
    _write(out / "generation_config.json", _json_bytes(generation))
    _write(out / "config.json", _json_bytes(config))
    return out
