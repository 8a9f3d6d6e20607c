"""RMSNorm (with the fused residual add) on the CPU as one native call (csrc/rmsnorm_cpu.c)
instead of the torch form's ~10 ops (reference.rmsnorm): a V3 decode step makes 17 of these
over a few rows each, where the ops' dispatch is most of the cost.

Same contract as reference.rmsnorm for fp32 CPU tensors of rank 2 whose channels are contiguous
(x's rows may be strided: a column slice of a projection). Built with the system C compiler at
first use (dsv4_kernels.native); where no compiler works, or DSV4_NO_NATIVE_NORM=1 or
DSV4_NO_NATIVE=1, `available()` is False and callers keep the torch form."""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from dsv4_kernels import native
from dsv4_kernels.native import F32, I64, P

_lib: Optional[ctypes.CDLL] = None


def available() -> bool:
    global _lib
    if _lib is None:
        _lib = native.load(
            "rmsnorm_cpu",
            ["-march=native"],
            off_env="DSV4_NO_NATIVE_NORM",
            signatures={
                "rmsnorm_rows": ([P, I64, I64, I64, P, P, P, F32, P], None),
            },
        )
    return _lib is not None


def supports(x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor] = None) -> bool:
    """Whether rmsnorm takes these: fp32 CPU, x [T, D] with contiguous channels, a contiguous
    weight [D] and residual [T, D]."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() == 2
        and x.stride(1) == 1
        and weight.dtype == torch.float32
        and weight.is_contiguous()
        and weight.shape == (x.shape[1],)
        and (
            residual is None
            or (residual.dtype == torch.float32 and residual.is_contiguous() and residual.shape == x.shape)
        )
    )


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, residual_out) as reference.rmsnorm: residual_out = x + residual (a new tensor) or
    x itself without one; out = weight * normalised residual_out."""
    assert _lib is not None, "call available() first"
    T, D = x.shape
    out = torch.empty(T, D, dtype=torch.float32)
    res_out = x if residual is None else torch.empty(T, D, dtype=torch.float32)
    _lib.rmsnorm_rows(
        x.data_ptr(),
        T,
        D,
        x.stride(0),
        None if residual is None else residual.data_ptr(),
        None if residual is None else res_out.data_ptr(),
        weight.data_ptr(),
        eps,
        out.data_ptr(),
    )
    return out, res_out
