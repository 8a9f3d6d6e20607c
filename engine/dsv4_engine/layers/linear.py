"""A projection y = x W^T with its weight dense or quantized (`QuantWeight`), and its place in
tensor parallelism.

dsv4_engine.parallel slices the checkpoint at load, so a layer holds this rank's part already:
a column-parallel weight (rows split: q_b, kv_b, gate/up) needs nothing after its GEMM; a row-
parallel one (columns split: o_proj, down) yields a partial sum that the ranks add up
(`tp.all_reduce`). A replicated weight is built like a column-parallel one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from dsv4_engine.quant import QuantWeight

Weight = torch.Tensor | QuantWeight


def reduce_of(tp) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """The sum over ranks a row-parallel output needs (None on one rank)."""
    return None if tp is None else tp.all_reduce


@dataclass
class Linear:
    weight: Weight
    ops: Any  # None: F.linear itself (torch's GEMM, or the QuantWeight's own kernel)
    reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # row parallel: the sum over ranks

    @classmethod
    def column(cls, weight: Weight, ops) -> "Linear":
        """Output rows split over ranks (or replicated): each rank's output is whole for its rows."""
        return cls(weight, ops)

    @classmethod
    def row(cls, weight: Weight, ops, tp) -> "Linear":
        """Input columns split over ranks: each rank's output is a partial sum, added up here."""
        return cls(weight, ops, reduce_of(tp))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight) if self.ops is None else self.ops.linear(x, self.weight)
        return y if self.reduce is None else self.reduce(y)
