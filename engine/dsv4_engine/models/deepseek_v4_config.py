"""DeepSeek-V4 model configuration: the fields of a `deepseek_v4` config.json the engine uses.

Two spellings exist in the wild and both are read here, resolved the way transformers resolves
them: the current one (`layer_types`, `mlp_layer_types`, `compress_rates`, `rope_parameters`
nested as {"main": ..., "compress": ...}) and the release one (`compress_ratios` per layer with
0 / 4 / 128, `compress_rate_csa` / `compress_rate_hca`, `num_hash_layers`, `qk_rope_head_dim`,
a flat `rope_scaling` / `rope_parameters` that applies to the compressed branches only).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from dsv4_engine.config import eos_id_list, plain_fields

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
_DEFAULT_RATES = {CSA: 4, HCA: 128}
_DERIVED = ("layer_types", "mlp_layer_types", "compress_rates", "qk_rope_head_dim", "rope_main", "rope_compress")


@dataclass
class RopeConfig:
    """One rope base: plain, or YaRN-scaled (the compressed branches of V4)."""

    theta: float
    dim: int  # rotated channels: the trailing qk_rope_head_dim of a head
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: Optional[int] = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0

    def inv_freq(self) -> torch.Tensor:
        """One inverse frequency per rotated pair, as transformers computes it (fp32)."""
        dim, base = self.dim, self.theta
        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        if self.rope_type == "default":
            return 1.0 / pos_freqs
        if self.rope_type != "yarn":
            raise ValueError(f"unsupported rope_type {self.rope_type!r} (default or yarn)")
        orig = self.original_max_position_embeddings

        def corr(rot: float) -> float:
            return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

        # transformers reads `truncate` off the top-level (main/compress) dict, so it is always on.
        low, high = math.floor(corr(self.beta_fast)), math.ceil(corr(self.beta_slow))
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        return (1.0 / (self.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


@dataclass
class DeepseekV4Config:
    # Derived in from_dict from either spelling (see the module docstring).
    layer_types: list[str]
    mlp_layer_types: list[str]
    compress_rates: dict[str, int]
    qk_rope_head_dim: int
    rope_main: RopeConfig
    rope_compress: RopeConfig
    # Read as written, else these defaults (transformers' DeepseekV4Config's).
    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048  # each routed expert and the shared expert
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    sliding_window: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    # transformers defaults to 1; the engine reads no MTP layer yet, so a config that says nothing
    # asks for none (the presets write 0)
    num_nextn_predict_layers: int = 0
    bos_token_id: Optional[int] = 0
    eos_token_id: Any = 1
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"
    # One rank's config under --tp-size N (parallel/plan.py): over how many ranks the attention's
    # query heads and output groups are split (their partial sums then meet in an all-reduce).
    attention_tp_size: int = 1
    extra: dict = field(default_factory=dict, repr=False)

    @property
    def eos_token_ids(self) -> list[int]:
        return eos_id_list(self.eos_token_id)

    @property
    def csa_rate(self) -> int:
        return self.compress_rates[CSA]

    @property
    def hca_rate(self) -> int:
        return self.compress_rates[HCA]

    def layers_of(self, layer_type: str) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == layer_type]

    @classmethod
    def from_dict(cls, d: dict) -> "DeepseekV4Config":
        if d.get("model_type") not in ("deepseek_v4", None):
            raise ValueError(f"unsupported model_type {d.get('model_type')!r} (expected deepseek_v4)")
        d = dict(d)
        if not d.get("torch_dtype") and d.get("dtype"):
            d["torch_dtype"] = d["dtype"]
        plain = plain_fields(cls, d, skip=_DERIVED)
        n, head_dim = plain["num_hidden_layers"], plain["head_dim"]

        rates = dict(d.get("compress_rates") or _DEFAULT_RATES)
        if d.get("compress_rate_csa") is not None:
            rates[CSA] = int(d["compress_rate_csa"])
        if d.get("compress_rate_hca") is not None:
            rates[HCA] = int(d["compress_rate_hca"])

        layer_types = d.get("layer_types")
        if layer_types is None and d.get("compress_ratios") is not None:
            try:
                layer_types = [_RATIO_TO_TYPE[int(r)] for r in d["compress_ratios"]]
            except KeyError as e:
                raise ValueError(f"compress_ratios entries must be 0, 4 or 128; got {e.args[0]}") from None
        if layer_types is None:  # transformers' default: two HCA layers, then CSA / HCA alternating
            layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        layer_types = list(layer_types[:n])

        mlp_types = d.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = int(d["num_hash_layers"]) if d.get("num_hash_layers") is not None else 3
            mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
        mlp_types = list(mlp_types[:n])
        for name, types, allowed in (
            ("layer_types", layer_types, LAYER_TYPES),
            ("mlp_layer_types", mlp_types, MLP_TYPES),
        ):
            if len(types) != n:
                raise ValueError(f"{name} has {len(types)} entries for {n} layers")
            bad = sorted({t for t in types if t not in allowed})
            if bad:
                raise ValueError(f"{name}: unknown types {bad}; allowed: {', '.join(allowed)}")

        prf = d.get("partial_rotary_factor")
        if prf is None:
            rope_dim = int(d["qk_rope_head_dim"]) if d.get("qk_rope_head_dim") is not None else head_dim // 8
        else:
            rope_dim = int(head_dim * float(prf))
        rope_theta, compress_theta = plain["rope_theta"], plain["compress_rope_theta"]
        max_pos = plain["max_position_embeddings"]

        rp = d.get("rope_parameters")
        if isinstance(rp, dict) and isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
            main_d, comp_d = rp["main"], rp["compress"]
        else:
            # Flat form: the scaling (rope_scaling, or flat rope_parameters) is the compressed
            # branches'; the main rope is plain at rope_theta.
            flat = dict(d.get("rope_scaling") or {})
            if isinstance(rp, dict):
                flat = {**flat, **{k: v for k, v in rp.items() if k not in ("main", "compress")}}
            main_d = {"rope_type": "default", "rope_theta": rope_theta}
            comp_d = {**flat, "rope_theta": compress_theta}
            comp_d.setdefault("rope_type", comp_d.get("type", "default"))
            if comp_d["rope_type"] == "yarn":
                comp_d.setdefault("attention_factor", 1.0)

        def rope(p: dict) -> RopeConfig:
            rtype = p.get("rope_type", p.get("type", "default"))
            dim = int(head_dim * float(p["partial_rotary_factor"])) if p.get("partial_rotary_factor") else rope_dim
            if rtype == "default":
                return RopeConfig(theta=float(p.get("rope_theta", rope_theta)), dim=dim)
            if rtype != "yarn":
                raise ValueError(f"unsupported rope_type {rtype!r} (default or yarn)")
            factor = p.get("factor")
            orig = int(p["original_max_position_embeddings"])
            if factor is None:
                factor = max_pos / orig
            attn = p.get("attention_factor")
            if attn is not None and float(attn) != 1.0:
                # cos/sin scaling would have to reach the compressed entries too; V4 ships 1.0
                raise ValueError(f"yarn attention_factor {attn} is not supported (DeepSeek-V4 uses 1.0)")
            if attn is None:
                raise ValueError("yarn rope without attention_factor: V4 needs it forced to 1.0")
            return RopeConfig(
                theta=float(p.get("rope_theta", compress_theta)),
                dim=dim,
                rope_type="yarn",
                factor=float(factor),
                original_max_position_embeddings=orig,
                beta_fast=float(p.get("beta_fast") or 32),
                beta_slow=float(p.get("beta_slow") or 1),
                attention_factor=1.0,
            )

        cfg = cls(
            layer_types=layer_types,
            mlp_layer_types=mlp_types,
            compress_rates={CSA: int(rates[CSA]), HCA: int(rates[HCA])},
            qk_rope_head_dim=rope_dim,
            rope_main=rope(main_d),
            rope_compress=rope(comp_d),
            **plain,
        )
        if cfg.scoring_func not in ("sqrtsoftplus", "sigmoid"):
            raise ValueError(f"unsupported scoring_func {cfg.scoring_func!r} (sqrtsoftplus or sigmoid)")
        if cfg.num_attention_heads % cfg.o_groups:
            raise ValueError("num_attention_heads must be a multiple of o_groups")
        cfg.extra = {k: v for k, v in d.items()}
        return cfg

    @classmethod
    def from_dir(cls, path: str | Path) -> "DeepseekV4Config":
        with open(Path(path) / "config.json") as f:
            return cls.from_dict(json.load(f))
