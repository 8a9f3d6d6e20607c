"""RMSNorm, in the two roundings the DeepSeek models use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass
class RMSNorm:
    """DeepSeek-V3's RMSNorm with its fused residual add (`ops.rmsnorm`): the normalised value is
    cast to x's dtype before the weight multiply, as transformers' DeepseekV3RMSNorm does."""

    weight: torch.Tensor
    eps: float
    ops: Any

    def __call__(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, residual out): with a residual, x + residual is normalised and returned as the
        next residual; without, x is."""
        return self.ops.rmsnorm(x, self.weight, self.eps, residual)


@dataclass
class V4RMSNorm:
    """DeepSeek-V4's RMSNorm (`ops.rms`): fp32 weight times the fp32 normed value, then x's dtype."""

    weight: torch.Tensor
    eps: float
    ops: Any

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms(x, self.weight, self.eps)
