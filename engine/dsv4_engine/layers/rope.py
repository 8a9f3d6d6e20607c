"""The rotary embedding as DeepSeek-V3 uses it: interleaved pairs, YaRN-scaled when configured,
cos/sin tables for every position made once."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def yarn_inv_freq(
    dim: int, base: float, rope_scaling: Optional[dict], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scale of the rope, with YaRN scaling when configured (as
    transformers computes them)."""
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    rs = rope_scaling or {}
    rope_type = rs.get("rope_type", rs.get("type", "default"))
    if rope_type in (None, "default"):
        return 1.0 / pos_freqs, 1.0
    if rope_type != "yarn":
        raise ValueError(f"unsupported rope_scaling type {rope_type!r} (default or yarn)")
    factor = float(rs["factor"])
    orig_max = rs.get("original_max_position_embeddings", max_position_embeddings)
    attn_factor = rs.get("attention_factor")
    if attn_factor is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attn_factor = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if (m and m_all) else yarn_mscale(factor)
    beta_fast = rs.get("beta_fast") or 32
    beta_slow = rs.get("beta_slow") or 1

    def correction_dim(rot: float) -> float:
        return (dim * math.log(orig_max / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attn_factor)


@dataclass
class RotaryEmbedding:
    """cos/sin [max_pos, dim / 2] (times YaRN's attention factor); applied in place to
    interleaved pairs by `ops.rope_interleaved_`."""

    cos: torch.Tensor
    sin: torch.Tensor
    ops: Any

    @classmethod
    def build(cls, cfg, device: torch.device, ops) -> "RotaryEmbedding":
        """From a V3 config: qk_rope_head_dim, rope_theta, rope_scaling, max_position_embeddings."""
        inv_freq, attn_factor = yarn_inv_freq(
            cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
        )
        freqs = torch.outer(torch.arange(max(cfg.max_position_embeddings, 1), dtype=torch.float32), inv_freq)
        return cls((freqs.cos() * attn_factor).to(device), (freqs.sin() * attn_factor).to(device), ops)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotates x [T, heads, dim] (may be a strided view) in place at positions [T]."""
        return self.ops.rope_interleaved_(x, positions, self.cos, self.sin)
