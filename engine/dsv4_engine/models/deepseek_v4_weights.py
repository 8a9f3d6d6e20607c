"""DeepSeek-V4 checkpoint names: every layout we read (DeepSeek's release, transformers'
save_pretrained / state_dict) renamed to the release names the model builds from."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from dsv4_engine.quant.scheme import MTP  # the layers no loader reads
from dsv4_engine.weights import load_weights


# Native transformers module names -> DeepSeek release names (the inverse of transformers'
# conversion mapping for deepseek_v4). Applied in order, after "model." is stripped.
_TO_RELEASE = [
    (r"^embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.sinks$", ".attn_sink"),
    (r"\.compressor\.indexer\.scorer\.weights_proj\.", ".indexer.weights_proj."),
    (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.wq_b."),
    (r"\.compressor\.indexer\.", ".indexer.compressor."),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.position_bias$", ".ape"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    # transformers' reverse mapping on save turns the attention's kv_norm into a bare `norm`
    (r"^(layers\.\d+\.attn)\.norm\.", r"\1.kv_norm."),
]


def release_name(name: str) -> str:
    """The DeepSeek release name of a tensor named in any layout we read."""
    n = name[len("model.") :] if name.startswith("model.") else name
    for pat, rep in _TO_RELEASE:
        n = re.sub(pat, rep, n)
    return n


def to_release_layout(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename to release names and split transformers' fused expert tensors per expert."""
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if MTP.search(name):
            continue
        n = release_name(name)
        m = re.match(r"^(layers\.\d+\.ffn\.experts)\.(gate_up_proj|down_proj)$", n)
        if m:
            prefix, kind = m.groups()
            for e in range(t.shape[0]):
                if kind == "gate_up_proj":
                    w1, w3 = t[e].chunk(2, dim=0)
                    out[f"{prefix}.{e}.w1.weight"], out[f"{prefix}.{e}.w3.weight"] = w1, w3
                else:
                    out[f"{prefix}.{e}.w2.weight"] = t[e]
            continue
        out[n] = t
    return out


def load_v4_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Read a V4 checkpoint in release or transformers layout; MTP tensors are never read."""
    return to_release_layout(load_weights(model_dir))
