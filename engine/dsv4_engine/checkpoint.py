"""Make DeepSeek-V3 and DeepSeek-V4 checkpoints here, without downloading anything: `dsv4 model init`.

A checkpoint is a Hugging Face folder with the same file and tensor layout as a real DeepSeek-V3
release (per-expert weights, `e_score_correction_bias`, `kv_a_proj_with_mqa`, ...; for V4 DeepSeek's
release names: `embed`, `layers.N.attn.wq_a`, `ffn.experts.E.w1`, `hc_*`, ...), random weights
from a seed, and a byte-level BPE tokenizer trained on the corpus shipped in `data/`. The same
preset and seed always give byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from dsv4_engine.tokenizer import BOS_TOKEN, CHAT_TEMPLATE, EOS_TOKEN, SPECIAL_TOKENS
from dsv4_wire.chat_tokens import CHAT_ADDED_TOKENS

if TYPE_CHECKING:
    import torch

TOKENIZER_VOCAB_SIZE = 512  # 256 bytes + 4 special tokens + 240 merges learned from the corpus + 12 chat markers

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
    # Enough routed experts for expert-parallel load balancing (EPLB, docs/eplb.md): 32 experts,
    # top-4 of 4 groups, learned (sigmoid + bias) routing in 3 MoE layers; small dims otherwise.
    "moe32": {
        **_COMMON,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "n_routed_experts": 32,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
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

# DeepSeek-V4 presets, in the spelling of V4's config.json. Layer and MLP types are listed so that
# every path (sliding / CSA / HCA attention, hash-routed and learned-routed MoE) is present.
_V4_COMMON = {
    "model_type": "deepseek_v4",
    "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": TOKENIZER_VOCAB_SIZE,
    "num_key_value_heads": 1,
    "hidden_act": "silu",
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "n_shared_experts": 1,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "use_cache": True,
    "initializer_range": 0.02,
}

V4_PRESETS: dict[str, dict] = {
    # Window 8, CSA every 4 tokens (top-4 of its entries), HCA every 8: a prompt of tens of tokens
    # crosses every window and compression boundary and makes the indexer drop entries. A small
    # swiglu_limit makes the clamp bite. Written in transformers' current config spelling.
    "v4-tiny": {
        **_V4_COMMON,
        "hidden_size": 128,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "head_dim": 64,
        "partial_rotary_factor": 0.25,  # 16 rope channels
        "q_lora_rank": 64,
        "o_groups": 2,
        "o_lora_rank": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "swiglu_limit": 1.5,
        "sliding_window": 8,
        "layer_types": [
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "index_n_heads": 8,
        "index_head_dim": 32,
        "index_topk": 4,
        "max_position_embeddings": 1024,
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            "compress": {
                "rope_type": "yarn",
                "rope_theta": 160000.0,
                "partial_rotary_factor": 0.25,
                "factor": 4.0,
                "original_max_position_embeddings": 256,
                "beta_fast": 32,
                "beta_slow": 1,
                "attention_factor": 1.0,
            },
        },
        "torch_dtype": "float32",
    },
}
# v4-tiny with a context long enough for an agent's conversation (tool results of 200-2,000
# tokens over several rounds; v4-tiny stops at 1,024 positions): the same weights' shapes, so the
# same fast steps, only max_position_embeddings differs.
V4_PRESETS["v4-tiny-long"] = {**V4_PRESETS["v4-tiny"], "max_position_embeddings": 16384}
# v4-tiny with enough routed experts for expert load balancing (EPLB, docs/eplb.md): 32 experts,
# top-4, one hash-routed layer and three learned (sqrt-softplus + bias) ones.
V4_PRESETS["v4-moe32"] = {
    **V4_PRESETS["v4-tiny"],
    "n_routed_experts": 32,
    "num_experts_per_tok": 4,
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
}
V4_PRESETS |= {
    # V4-Flash's per-layer widths (hidden 4096, 64 heads of 512 with 64 rope channels, q LoRA 1024,
    # 8 output groups of 1024, indexer 64 x 128 top-512, window 128, CSA 4 / HCA 128) with one
    # layer of each attention type and 4 small experts, stored in bf16 (~0.8 GB). Written in
    # the release config spelling (compress_ratios, num_hash_layers, qk_rope_head_dim, rope_scaling).
    "v4-flash-shape": {
        **_V4_COMMON,
        "hidden_size": 4096,
        "moe_intermediate_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 64,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 1024,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "swiglu_limit": 10.0,
        "sliding_window": 128,
        "compress_ratios": [0, 4, 128],
        "num_hash_layers": 1,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "max_position_embeddings": 65536,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "torch_dtype": "bfloat16",
    },
}
PRESETS.update(V4_PRESETS)

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
    for i in range(c["num_hidden_layers"] + (c.get("num_nextn_predict_layers", 0) or 0)):
        p = f"model.layers.{i}."
        if c.get("q_lora_rank"):
            shapes[p + "self_attn.q_a_proj.weight"] = (c["q_lora_rank"], h)
            shapes[p + "self_attn.q_a_layernorm.weight"] = (c["q_lora_rank"],)
            shapes[p + "self_attn.q_b_proj.weight"] = (heads * qk_head, c["q_lora_rank"])
        else:
            shapes[p + "self_attn.q_proj.weight"] = (heads * qk_head, h)
        shapes[p + "self_attn.kv_a_proj_with_mqa.weight"] = (c["kv_lora_rank"] + c["qk_rope_head_dim"], h)
        shapes[p + "self_attn.kv_a_layernorm.weight"] = (c["kv_lora_rank"],)
        shapes[p + "self_attn.kv_b_proj.weight"] = (
            heads * (c["qk_nope_head_dim"] + c["v_head_dim"]),
            c["kv_lora_rank"],
        )
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
    for n in range(c.get("num_nextn_predict_layers", 0) or 0):
        shapes.update(mtp_extra_shapes(c, c["num_hidden_layers"] + n))
    return shapes


def mtp_extra_shapes(c: dict, layer: int) -> dict[str, tuple[int, ...]]:
    """The tensors a DeepSeek-V3 multi-token-prediction block has besides an ordinary decoder
    layer (which `tensor_shapes` writes at the same index, after the last main layer): norms of
    the token embedding and of the previous hidden state, their joint projection, and its own
    output head (embed_tokens and shared_head.head are copies of the main ones, as released)."""
    h, p = c["hidden_size"], f"model.layers.{layer}."
    return {
        p + "embed_tokens.weight": (c["vocab_size"], h),
        p + "enorm.weight": (h,),
        p + "hnorm.weight": (h,),
        p + "eh_proj.weight": (h, 2 * h),
        p + "shared_head.norm.weight": (h,),
        p + "shared_head.head.weight": (c["vocab_size"], h),
    }


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


def v4_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a DeepSeek-V4 checkpoint, named as in DeepSeek's release files (the names
    transformers' conversion mapping for deepseek_v4 renames from); MTP blocks as `mtp.N.*`."""
    from dsv4_engine.models.deepseek_v4_config import CSA, HCA, DeepseekV4Config

    c = DeepseekV4Config.from_dict(config)
    D, H, hd, ql, hc = c.hidden_size, c.num_attention_heads, c.head_dim, c.q_lora_rank, c.hc_mult
    E, inter = c.n_routed_experts, c.moe_intermediate_size
    n_mix = (2 + hc) * hc
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (c.vocab_size, D)}
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        shapes[p + "attn_norm.weight"] = (D,)
        shapes[p + "ffn_norm.weight"] = (D,)
        for site in ("attn", "ffn"):
            shapes[p + f"hc_{site}_fn"] = (n_mix, hc * D)
            shapes[p + f"hc_{site}_base"] = (n_mix,)
            shapes[p + f"hc_{site}_scale"] = (3,)
        a = p + "attn."
        shapes[a + "wq_a.weight"] = (ql, D)
        shapes[a + "q_norm.weight"] = (ql,)
        shapes[a + "wq_b.weight"] = (H * hd, ql)
        shapes[a + "wkv.weight"] = (hd, D)
        shapes[a + "kv_norm.weight"] = (hd,)
        shapes[a + "wo_a.weight"] = (c.o_groups * c.o_lora_rank, H * hd // c.o_groups)
        shapes[a + "wo_b.weight"] = (D, c.o_groups * c.o_lora_rank)
        shapes[a + "attn_sink"] = (H,)
        kind = c.layer_types[i]
        if kind in (CSA, HCA):
            rate = c.compress_rates[kind]
            width = 2 * hd if kind == CSA else hd  # CSA carries two overlapping series
            shapes[a + "compressor.wkv.weight"] = (width, D)
            shapes[a + "compressor.wgate.weight"] = (width, D)
            shapes[a + "compressor.ape"] = (rate, width)
            shapes[a + "compressor.norm.weight"] = (hd,)
        if kind == CSA:
            ihd, IH = c.index_head_dim, c.index_n_heads
            shapes[a + "indexer.wq_b.weight"] = (IH * ihd, ql)
            shapes[a + "indexer.weights_proj.weight"] = (IH, D)
            shapes[a + "indexer.compressor.wkv.weight"] = (2 * ihd, D)
            shapes[a + "indexer.compressor.wgate.weight"] = (2 * ihd, D)
            shapes[a + "indexer.compressor.ape"] = (c.csa_rate, 2 * ihd)
            shapes[a + "indexer.compressor.norm.weight"] = (ihd,)
        f = p + "ffn."
        shapes[f + "gate.weight"] = (E, D)
        if c.mlp_layer_types[i] == "hash_moe":
            shapes[f + "gate.tid2eid"] = (c.vocab_size, c.num_experts_per_tok)
        else:
            shapes[f + "gate.bias"] = (E,)
        for e in range(E):
            shapes[f + f"experts.{e}.w1.weight"] = (inter, D)
            shapes[f + f"experts.{e}.w2.weight"] = (D, inter)
            shapes[f + f"experts.{e}.w3.weight"] = (inter, D)
        shapes[f + "shared_experts.w1.weight"] = (inter, D)
        shapes[f + "shared_experts.w2.weight"] = (D, inter)
        shapes[f + "shared_experts.w3.weight"] = (inter, D)
    shapes["norm.weight"] = (D,)
    shapes["hc_head_fn"] = (hc, hc * D)
    shapes["hc_head_base"] = (hc,)
    shapes["hc_head_scale"] = (1,)
    shapes["head.weight"] = (c.vocab_size, D)
    for n in range(c.num_nextn_predict_layers):
        shapes.update(v4_mtp_shapes(config, n))
    return shapes


def v4_mtp_shapes(config: dict, n: int = 0) -> dict[str, tuple[int, ...]]:
    """DeepSeek-V4's MTP block n, as in the release (`mtp.{n}.*`): a sliding-window layer with a
    routed (not hashed) MoE, plus e_proj / h_proj (the next token's embedding and the previous
    hidden streams, each normed by enorm / hnorm), its output norm and its own mHC head."""
    from dsv4_engine.models.deepseek_v4_config import SLIDING

    one = {
        **config,
        "num_hidden_layers": 1,
        "layer_types": [SLIDING],
        "mlp_layer_types": ["moe"],
        "num_nextn_predict_layers": 0,
    }
    one.pop("compress_ratios", None)
    D, hc = config["hidden_size"], config["hc_mult"]
    p = f"mtp.{n}."
    shapes = {p + k[len("layers.0.") :]: v for k, v in v4_tensor_shapes(one).items() if k.startswith("layers.0.")}
    shapes.update(
        {
            p + "e_proj.weight": (D, D),
            p + "h_proj.weight": (D, D),
            p + "enorm.weight": (D,),
            p + "hnorm.weight": (D,),
            p + "norm.weight": (D,),
            p + "hc_head_fn": (hc, hc * D),
            p + "hc_head_base": (hc,),
            p + "hc_head_scale": (1,),
        }
    )
    return shapes


def _v4_mean_std(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    leaf = name.removesuffix(".weight").rsplit(".", 1)[-1]
    if name.endswith("norm.weight"):
        return 1.0, NORM_NOISE_STD
    if name == "embed.weight":
        return 0.0, 1.0
    if name == "head.weight":
        return 0.0, LOGIT_STD / math.sqrt(shape[1])
    if name.endswith("ffn.gate.weight"):
        return 0.0, ROUTER_LOGIT_STD / math.sqrt(shape[1])
    if name.endswith("gate.bias"):
        return 0.0, SCORE_BIAS_STD
    if leaf.endswith("_scale"):  # mHC scales multiply unit-size mixing logits
        return 1.0, NORM_NOISE_STD
    if leaf.endswith("_base"):
        return 0.0, 0.5
    if leaf in ("attn_sink", "ape"):
        return 0.0, 0.5
    return 0.0, 1.0 / math.sqrt(shape[1])


def init_v4_weights(config: dict, seed: int = 0) -> dict[str, "torch.Tensor"]:
    import torch

    store = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.get("torch_dtype", "float32")]
    weights = {}
    for name, shape in v4_tensor_shapes(config).items():
        gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
        if name.endswith("tid2eid"):
            # A frozen token -> experts table: distinct experts per token, as a hash would give.
            weights[name] = (
                torch.rand(shape[0], config["n_routed_experts"], generator=gen)
                .argsort(dim=1)[:, : shape[1]]
                .to(torch.int32)
                .contiguous()
            )
            continue
        mean, std = _v4_mean_std(name, shape)
        t = torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean
        # mHC, sinks, position biases and norms stay fp32 in V4's release; the rest is stored as configured.
        fp32 = any(k in name for k in ("hc_", "attn_sink", ".ape", "norm.weight", "gate.bias"))
        weights[name] = t.to(torch.float32 if fp32 else store).contiguous()
    return weights


def init_weights(config: dict, seed: int = 0) -> dict[str, "torch.Tensor"]:
    if config.get("model_type") == "deepseek_v4":
        return init_v4_weights(config, seed)
    import torch  # here, not at the top: reading PRESETS (e.g. `dsv4 model init --help`) stays fast

    weights = {}
    for name, shape in tensor_shapes(config).items():
        if name.endswith(".embed_tokens.weight") and name != "model.embed_tokens.weight":
            continue  # an MTP block's copies of the main embedding and head, below
        if name.endswith(".shared_head.head.weight"):
            continue
        mean, std = _mean_std(name, shape)
        gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
        weights[name] = (torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean).contiguous()
    for n in range(config.get("num_nextn_predict_layers", 0) or 0):
        p = f"model.layers.{config['num_hidden_layers'] + n}."
        weights[p + "embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
        weights[p + "shared_head.head.weight"] = weights["lm_head.weight"].clone()
    return weights


def corpus_lines() -> list[str]:
    text = resources.files("dsv4_engine").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def train_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE) -> BackendTokenizer:
    """A byte-level BPE learned from the shipped corpus (deterministic: same corpus, same merges).
    Byte-level means every string is encodable; the post-processor prepends bos, as DeepSeek's does."""
    from tokenizers import AddedToken

    tok = BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(CHAT_ADDED_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    # DeepSeek's thinking and tool-call markers, as the releases have them: single tokens that are
    # not "special" (a decode that skips special tokens keeps them, so the parsers see them).
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in CHAT_ADDED_TOKENS])
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


# ---- quantized checkpoints ------------------------------------------------------------------------

QUANT_CHOICES = ("fp8", "fp4-experts")

# Linear weights the releases ship in fp8: DeepSeek-V3's attention and MLP projections (not the
# embedding, the head or the router); DeepSeek-V4's attention, indexer query and MLP projections
# (its compressors and the indexer's weights_proj stay bf16, as transformers' V4 notes).
_V3_FP8 = re.compile(
    r"\.(self_attn\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(experts\.\d+\.|shared_experts\.)?(gate_proj|up_proj|down_proj))\.weight$"
)
_V4_FP8 = re.compile(
    r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b"
    r"|ffn\.(experts\.\d+|shared_experts)\.(w1|w2|w3))\.weight$"
)
_V4_ROUTED = re.compile(r"\.ffn\.experts\.\d+\.(w1|w2|w3)\.weight$")


def quantization_config(config: dict, quant: str) -> dict:
    """The quantization_config a checkpoint of this model type carries: V3's release spelling
    (fp32 block scales), V4's (power-of-two ue8m0 scales, fp4 routed experts when asked)."""
    q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    if config.get("model_type") == "deepseek_v4":
        q["scale_fmt"] = "ue8m0"
        q["expert_dtype"] = "fp4" if quant == "fp4-experts" else "fp8"
    return q


def quantize_weights(config: dict, weights: dict[str, "torch.Tensor"], quant: str) -> dict[str, "torch.Tensor"]:
    """Float weights -> the tensors of a quantized checkpoint (each quantized weight followed by
    its scales: V3 `.weight_scale_inv` fp32 per 128x128 block; V4 `.scale` in ue8m0, per block for
    fp8 and per 32 values of a row for fp4 routed experts). Deterministic."""
    import torch

    from dsv4_engine.quant.codec import quantize_fp4, quantize_fp8_block

    if quant not in QUANT_CHOICES:
        raise ValueError(f"unknown --quant {quant!r}; choose one of {', '.join(QUANT_CHOICES)}")
    v4 = config.get("model_type") == "deepseek_v4"
    if quant == "fp4-experts" and not v4:
        raise ValueError("--quant fp4-experts is DeepSeek-V4's format: use a v4-* preset (or --quant fp8)")
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        base = name[: -len(".weight")]
        if v4 and quant == "fp4-experts" and _V4_ROUTED.search(name):
            q, exps = quantize_fp4(t)
            out[name], out[base + ".scale"] = q, exps.view(torch.float8_e8m0fnu)
        elif (_V4_FP8 if v4 else _V3_FP8).search(name):
            q, s = quantize_fp8_block(t, pow2=v4)
            out[name] = q
            if v4:
                out[base + ".scale"] = s.to(torch.float8_e8m0fnu)
            else:
                out[base + ".weight_scale_inv"] = s
        else:
            out[name] = t
    return out


def dequantize_checkpoint(src: str | Path, dst: str | Path, dtype: str = "float32") -> Path:
    """Write the float twin of a quantized checkpoint: same tensor names, every quantized weight
    dequantized with its scales, no quantization_config (what transformers runs as the oracle)."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from dsv4_engine.quant import QuantWeight
    from dsv4_engine.weights import load_weights

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").unlink(missing_ok=True)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    weights = {
        k: (v.dequantize(dt) if isinstance(v, QuantWeight) else v).contiguous() for k, v in load_weights(src).items()
    }
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / f).is_file():
            shutil.copyfile(src / f, dst / f)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    config.pop("expert_dtype", None)
    config["torch_dtype"] = dtype
    _write(dst / "config.json", _json_bytes(config))
    return dst


def _extend(types: list, n: int) -> list:
    """The first n of a per-layer list; past its end, its last two entries keep alternating."""
    out = list(types[:n])
    period = 2 if len(types) >= 2 else 1
    while len(out) < n:
        out.append(out[-period])
    return out


def v4_with_depth(config: dict, n: int) -> dict:
    """A V4 preset's config at depth n. V4 configs lay out each layer: the attention types
    (`layer_types`, or the release's `compress_ratios`) keep the preset's first layers and then
    alternate its last two (v4-tiny: sliding, CSA, HCA, CSA, HCA, CSA, ...: CSA and HCA layers
    interleaved after the first, as in V4-Flash); the MLP types keep the preset's hash-routed
    layers first (`mlp_layer_types` or `num_hash_layers`) and learned routing after them.
    Written in the preset's own spelling, so the config reads the same in transformers."""
    config = dict(config)
    config["num_hidden_layers"] = n
    for key in ("layer_types", "compress_ratios"):
        if key in config:
            config[key] = _extend(config[key], n)
    if "mlp_layer_types" in config:
        hashed = [t for t in config["mlp_layer_types"] if t == "hash_moe"]
        config["mlp_layer_types"] = (hashed + ["moe"] * n)[:n]
    elif "num_hash_layers" in config:
        config["num_hash_layers"] = min(int(config["num_hash_layers"]), n)
    return config


def init_checkpoint(
    out_dir: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    quant: str | None = None,
    mtp: bool = False,
    num_layers: int | None = None,
) -> Path:
    """Write a checkpoint of `preset` with weights from `seed` into out_dir and return its path;
    with `quant` ("fp8", or "fp4-experts" for V4 presets) its linear weights are quantized from
    the float ones; `num_layers` overrides the preset's num_hidden_layers (a deeper model makes
    one MTP layer's share of a forward realistic). config.json is written last, so a folder that
    has one is complete."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    config = dict(PRESETS[preset])
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"--num-layers must be at least 1, got {num_layers}")
        if config.get("model_type") == "deepseek_v4":
            config = v4_with_depth(config, num_layers)
        else:
            config["num_hidden_layers"] = num_layers
    if mtp:  # one multi-token-prediction block: V3's `model.layers.N.*`, V4's `mtp.0.*`
        config["num_nextn_predict_layers"] = 1
    if quant is not None:
        if quant not in QUANT_CHOICES:
            raise ValueError(f"unknown --quant {quant!r}; choose one of {', '.join(QUANT_CHOICES)}")
        if quant == "fp4-experts" and config.get("model_type") != "deepseek_v4":
            raise ValueError(f"--quant fp4-experts is DeepSeek-V4's format; preset {preset!r} is DeepSeek-V3")
        config["quantization_config"] = quantization_config(config, quant)
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
    weights = init_weights(config, seed)
    if quant is not None:
        weights = quantize_weights(config, weights, quant)
    save_file(weights, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)  # safetensors creates it owner-only; the other files are world-readable too
    os.replace(tmp, out / "model.safetensors")

    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"], "do_sample": False}
    _write(out / "generation_config.json", _json_bytes(generation))
    _write(out / "config.json", _json_bytes(config))
    return out
