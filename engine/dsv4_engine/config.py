"""Model configuration: the fields of a DeepSeek-V3 `config.json` that the engine uses."""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Optional


def eos_id_list(eos: Any) -> list[int]:
    """config.json's eos_token_id (None, an id, or a list of ids) as a list."""
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


_SCALARS = {"int": int, "float": float, "bool": bool, "str": str}


def plain_fields(cls, d: dict, skip: Iterable[str] = ()) -> dict:
    """config.json's values for the dataclass ``cls``'s fields (all but ``extra`` and ``skip``),
    each from ``d`` or else the field's own default — the one place a default is written — with
    int/float/bool/str fields coerced (config files write 4096 as 4096.0, 1e-6 as a string) and a
    null there taken as "not set"; Optional and Any fields keep a null."""
    out = {}
    for f in fields(cls):
        if f.name == "extra" or f.name in skip:
            continue
        kind = _SCALARS.get(f.type if isinstance(f.type, str) else getattr(f.type, "__name__", ""))
        v = d.get(f.name)
        if f.name not in d or (v is None and kind is not None):  # a null plain number means "not set"
            if f.default is MISSING:
                raise ValueError(f"config.json lacks {f.name!r}")
            out[f.name] = f.default
        else:
            out[f.name] = kind(v) if kind is not None else v
    return out


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width
    moe_intermediate_size: int  # width of one routed (and each shared) expert
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 4096
    bos_token_id: Optional[int] = 0
    eos_token_id: Any = 1
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"
    q_lora_rank: Optional[int] = None  # None: q is projected directly (DeepSeek-V2-Lite style)
    extra: dict = field(default_factory=dict, repr=False)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Width of one cached token in one layer: the latent followed by the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def eos_token_ids(self) -> list[int]:
        return eos_id_list(self.eos_token_id)

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        if d.get("model_type") not in ("deepseek_v3", "deepseek_v2", None):
            raise ValueError(f"unsupported model_type {d.get('model_type')!r} (expected deepseek_v3)")
        known = {f.name for f in fields(cls)} - {"extra"}
        d = dict(d)
        rp = d.get("rope_parameters")
        if isinstance(rp, dict):  # transformers >= 5 keeps theta and scaling together here
            d.setdefault("rope_theta", rp.get("rope_theta"))
            if rp.get("rope_type", "default") != "default" and not d.get("rope_scaling"):
                d["rope_scaling"] = rp
        if "torch_dtype" not in d and "dtype" in d:
            d["torch_dtype"] = d["dtype"]
        kwargs = plain_fields(cls, d)
        cfg = cls(**kwargs)
        cfg.extra = {k: v for k, v in d.items() if k not in known}
        return cfg

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        with open(Path(path) / "config.json") as f:
            return cls.from_dict(json.load(f))
