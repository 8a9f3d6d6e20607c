"""The interleaved rope in place on the CPU as one native call (csrc/rope_cpu.c) instead of the
torch form's ~12 ops (reference.rope_interleaved_): a V3 decode step makes 8 of these over a few
rows each. Built without fused multiply-adds, so bit for bit the torch form's result on fp32.

Where no compiler works, or DSV4_NO_NATIVE_ROPE=1 or DSV4_NO_NATIVE=1, `available()` is False
and callers keep the torch form."""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from dsv4_kernels import native
from dsv4_kernels.native import I64, P

_lib: Optional[ctypes.CDLL] = None


def available() -> bool:
    global _lib
    if _lib is None:
        _lib = native.load(
            "rope_cpu",
            ["-march=native", "-ffp-contract=off"],
            off_env="DSV4_NO_NATIVE_ROPE",
            signatures={
                "rope_interleaved_rows": ([P, I64, I64, I64, I64, I64, P, P, P, I64, I64], ctypes.c_int),
            },
        )
    return _lib is not None


def supports(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """fp32 CPU x [T, n, R] (any row strides, contiguous channels), int64 positions [T], fp32
    cos/sin tables [max_pos, R / 2] with contiguous rows and the same strides."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() == 3
        and x.stride(2) == 1
        and x.shape[2] % 2 == 0
        and positions.dtype == torch.int64
        and positions.is_contiguous()
        and positions.shape == (x.shape[0],)
        and cos.dtype == sin.dtype == torch.float32
        and cos.dim() == 2
        and cos.shape == sin.shape
        and cos.shape[1] == x.shape[2] // 2
        and cos.stride(1) == sin.stride(1) == 1
        and cos.stride(0) == sin.stride(0)
    )


def rope_interleaved_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """As reference.rope_interleaved_ (x rotated in place and returned). A position outside the
    tables is an IndexError here, as the torch form's indexing raises."""
    assert _lib is not None, "call available() first"
    T, n, R = x.shape
    status = _lib.rope_interleaved_rows(
        x.data_ptr(),
        T,
        n,
        x.stride(0),
        x.stride(1),
        R // 2,
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        cos.stride(0),
        cos.shape[0],
    )
    if status:
        raise IndexError(f"rope position outside [0, {cos.shape[0]})")
    return x
