"""A weight kept quantized in memory: what a model holds instead of a dense matrix on GPU.

`QuantWeight` holds the quantized values and their scales (see dsv4_kernels.reference_quant for
the two formats): fp8 keeps the checkpoint's 128x128 block scales as they are (resident bytes =
checkpoint bytes), fp4 one scale per row and 32 values. Model code keeps calling `F.linear(x, w)`:
the object takes part in torch's `__torch_function__` protocol and turns that call into the
block-scaled kernel of the engine's kernel backend (`kernels`, set when the weight is placed:
Triton's on the triton backend, the torch reference on the others). Row concatenation
(`torch.cat`), stacking experts (`torch.stack`), indexing an expert and chunking rows work too;
where rows of different blocks would share a scale row (a part whose row count is not a multiple
of 128), the scales are first repeated per row (+4/128 bytes per value for that weight only).
Anything else raises: a quantized weight is never silently read as if it were dense.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dsv4_kernels.reference_quant import FP4_GROUP, FP8_GROUP, dequantize_fp4, dequantize_fp8_rows, scale_row_block

FP8, FP4 = "fp8", "fp4"


@dataclass
class QuantWeight:
    kind: str  # FP8: data e4m3 [..., N, K], scale fp32 [..., ceil(N/128) or N, ceil(K/128)]
    data: torch.Tensor  # FP4: data uint8 [..., N, K/2], scale uint8 e8m0 [..., N, K/32]
    scale: torch.Tensor
    k: int  # logical input width K
    kernels: Any = None  # the kernel backend whose fp8/fp4 GEMMs run it (None: the torch reference)

    @property
    def group(self) -> int:
        return FP8_GROUP if self.kind == FP8 else FP4_GROUP

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.data.shape[:-1], self.k))

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dim(self) -> int:
        return self.data.dim()

    @property
    def row_block(self) -> int:
        """Weight rows per row of scales (128: block scales as stored; 1: per row)."""
        return scale_row_block(self.data, self.scale) if self.kind == FP8 else 1

    def per_row(self) -> "QuantWeight":
        """The same weight with one row of scales per weight row."""
        rb = self.row_block
        if rb == 1:
            return self
        n = self.data.shape[-2]
        return QuantWeight(
            self.kind,
            self.data,
            self.scale.repeat_interleave(rb, dim=-2)[..., :n, :].contiguous(),
            self.k,
            self.kernels,
        )

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.kind == FP8:
            return dequantize_fp8_rows(self.data, self.scale, FP8_GROUP, dtype)
        return dequantize_fp4(self.data, self.scale, FP4_GROUP, dtype)

    def to(self, device=None, **_: Any) -> "QuantWeight":
        return QuantWeight(self.kind, self.data.to(device), self.scale.to(device), self.k, self.kernels)

    def contiguous(self) -> "QuantWeight":
        return QuantWeight(self.kind, self.data.contiguous(), self.scale.contiguous(), self.k, self.kernels)

    def __getitem__(self, idx) -> "QuantWeight":
        """Leading-dimension indexing (an expert of a stack, a range of rows of a matrix)."""
        w = self.per_row() if self.data.dim() == 2 else self
        data, scale = w.data[idx], w.scale[idx]
        if data.dim() < 2 or data.shape[-1] != self.data.shape[-1]:
            raise IndexError("a QuantWeight can be indexed by experts or rows only")
        return QuantWeight(self.kind, data, scale, self.k, self.kernels)

    def chunk(self, chunks: int, dim: int = 0) -> tuple["QuantWeight", ...]:
        if dim not in (-2, self.data.dim() - 2):
            raise ValueError("a QuantWeight can be chunked along its rows only")
        n, rb = self.data.shape[-2], self.row_block
        w = self if n % chunks == 0 and (n // chunks) % rb == 0 else self.per_row()
        return tuple(
            QuantWeight(self.kind, d, s, self.k, self.kernels)
            for d, s in zip(w.data.chunk(chunks, -2), w.scale.chunk(chunks, -2))
        )

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] @ W^T -> [..., N] in x's dtype."""
        if self.data.dim() != 2:
            raise ValueError("F.linear needs a 2-D weight; index the expert first")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        ops = self.kernels or _reference()
        run = ops.fp8_linear if self.kind == FP8 else ops.fp4_linear
        y = run(x2, self.data, self.scale)
        return y.reshape(*lead, y.shape[-1])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear or func is torch._C._nn.linear:
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            y = w.linear(x)
            return y if bias is None else y + bias
        if func in (torch.cat, torch.stack):
            parts = list(args[0])
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            if not all(isinstance(p, QuantWeight) and p.kind == parts[0].kind and p.k == parts[0].k for p in parts):
                raise TypeError(f"{func.__name__} of quantized weights needs weights of one format and width")
            rows = (0, -2) if parts[0].data.dim() == 2 else (-2,)
            if func is torch.cat and dim not in rows:
                raise ValueError("quantized weights concatenate along rows only")
            if func is torch.stack and dim != 0:
                raise ValueError("quantized weights stack along a new first dimension only")
            blocks = {p.row_block for p in parts}
            aligned = len(blocks) == 1 and all(p.data.shape[-2] % p.row_block == 0 for p in parts[:-1])
            if func is torch.stack:
                aligned = aligned and len({p.data.shape for p in parts}) == 1
            if not aligned:  # rows of different blocks would share a scale row: scales per row
                parts = [p.per_row() for p in parts]
            return QuantWeight(
                parts[0].kind,
                func([p.data for p in parts], dim),
                func([p.scale for p in parts], dim),
                parts[0].k,
                parts[0].kernels,
            )
        raise TypeError(
            f"{getattr(func, '__name__', func)} is not defined on a quantized ({types}) weight: only F.linear, "
            f"torch.cat/stack of rows and expert indexing are; dequantize it at load instead"
        )


def dense(t, dtype: torch.dtype) -> torch.Tensor:
    """A dense tensor in dtype, dequantizing a QuantWeight (for weights used other than by F.linear)."""
    return t.dequantize(dtype) if isinstance(t, QuantWeight) else t.to(dtype)


def one_format(parts: list) -> list:
    """Weights about to be concatenated into one: as they are when they share a format, else all
    dense in the dense parts' dtype (a fused projection of fp8 and bf16 weights, e.g. V4's
    quantized wq_a with its bf16 compressor, has to be one or the other)."""
    kinds = {p.kind if isinstance(p, QuantWeight) else "dense" for p in parts}
    if len(kinds) == 1:
        return parts
    dtype = next(p.dtype for p in parts if not isinstance(p, QuantWeight))
    return [dense(p, dtype) for p in parts]


def is_quantized(t) -> bool:
    return isinstance(t, QuantWeight)


_REFERENCE: list = []  # the torch backend, made on first use


def _reference():
    if not _REFERENCE:
        from dsv4_kernels.api import get_ops

        _REFERENCE.append(get_ops("torch"))
    return _REFERENCE[0]


def moe_experts_for(ops, swiglu_limit=None):
    """The routed-experts call a model makes: the backend's block-scaled expert kernels when the
    stacked weights are QuantWeights (CUDA), else the backend's own `ops.moe_experts`."""

    def moe_experts(x, w13, w2, topk_weights, topk_ids):
        if not isinstance(w13, QuantWeight):
            return ops.moe_experts(x, w13, w2, topk_weights, topk_ids)
        if w13.kind != w2.kind:
            raise TypeError("gate/up and down experts must share one format")
        run = ops.fp8_moe_experts if w13.kind == FP8 else ops.fp4_moe_experts
        return run(x, w13.data, w13.scale, w2.data, w2.scale, topk_weights, topk_ids, swiglu_limit)

    return moe_experts
