"""The dense SwiGLU MLP, w2 (silu(gate x) * (up x)): gate/up rows column-parallel, down columns
row-parallel under tensor parallelism (one sum over ranks after it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from dsv4_engine.layers.linear import Weight, reduce_of


@dataclass
class GatedMLP:
    w13: Weight  # [2I, D]: gate rows, then up rows
    w2: Weight  # [D, I]
    ops: Any
    reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    @classmethod
    def build(cls, take, prefix: str, ops, tp) -> "GatedMLP":
        """From `{prefix}gate_proj/up_proj/down_proj.weight` (DeepSeek-V3's names)."""
        w13 = torch.cat([take(prefix + "gate_proj.weight"), take(prefix + "up_proj.weight")], 0)
        return cls(w13, take(prefix + "down_proj.weight"), ops, reduce_of(tp))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ops.mlp(x, self.w13, self.w2)
        return y if self.reduce is None else self.reduce(y)
