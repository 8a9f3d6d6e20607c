"""The passes around a prefill-sized MoE's GEMMs on the CPU as native calls (csrc/grouped_moe_cpu.c):
the pairs' row gather, the SwiGLU silu(gate) * up in one pass, and the top-k combine (weight,
sum over k, plus the shared expert's output) in one pass. At a 1048-token step the torch forms
of these were ~6 ms a layer around ~20 ms of GEMMs (dsv4_kernels.grouped_moe).

`combine` is bit for bit the torch form's sum; `swiglu` differs from torch's silu by rounding
(its own exp). fp32 CPU tensors only. Built with the system C compiler at first use
(dsv4_kernels.native); where no compiler works, or DSV4_NO_NATIVE_GROUPED_MOE=1 or
DSV4_NO_NATIVE=1, `available()` is False and callers keep the torch forms."""

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
            "grouped_moe_cpu",
            ["-march=native", "-ffp-contract=off"],  # combine's products round before their sum
            off_env="DSV4_NO_NATIVE_GROUPED_MOE",
            signatures={
                "gather_rows": ([P, I64, P, I64, I64, P], None),
                "swiglu_rows": ([P, I64, I64, I64, P], None),
                "combine_rows": ([P, P, P, I64, I64, I64, P, P], None),
            },
        )
    return _lib is not None


def _f32(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor and t.dtype == torch.float32 and t.device.type == "cpu"


def supports(*tensors: torch.Tensor) -> bool:
    """Whether these (activations, weights) are fp32 CPU tensors and the build is here."""
    return all(_f32(t) for t in tensors) and available()


def gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x[rows] for x [T, D] with contiguous channels, rows int64 [n] in [0, T)."""
    assert _lib is not None, "call available() first"
    n, D = rows.shape[0], x.shape[1]
    assert x.stride(1) == 1 and rows.dtype == torch.int64 and rows.is_contiguous()
    out = torch.empty(n, D, dtype=torch.float32)
    _lib.gather_rows(x.data_ptr(), x.stride(0), rows.data_ptr(), n, D, out.data_ptr())
    return out


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate_up[:, :I]) * gate_up[:, I:] as [n, I] (gate_up [n, 2I], contiguous channels)."""
    assert _lib is not None, "call available() first"
    n, I2 = gate_up.shape
    assert gate_up.stride(1) == 1 and I2 % 2 == 0
    h = torch.empty(n, I2 // 2, dtype=torch.float32)
    _lib.swiglu_rows(gate_up.data_ptr(), n, I2 // 2, gate_up.stride(0), h.data_ptr())
    return h


def combine(ys: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor, add: Optional[torch.Tensor] = None):
    """out[t] = sum_k weights[t,k] * ys[pos[t,k]] (+ add[t]), rounded as torch's weight, sum
    over k, then add; a pair with pos < 0 adds nothing. ys [P, D], pos int64 [T, k], weights
    fp32 [T, k], add [T, D]; all contiguous."""
    assert _lib is not None, "call available() first"
    T, k = pos.shape
    D = ys.shape[1]
    assert ys.is_contiguous() and pos.is_contiguous() and pos.dtype == torch.int64
    assert weights.is_contiguous() and weights.shape == pos.shape and _f32(weights)
    assert add is None or (add.is_contiguous() and add.shape == (T, D))
    out = torch.empty(T, D, dtype=torch.float32)
    _lib.combine_rows(
        ys.data_ptr(),
        pos.data_ptr(),
        weights.data_ptr(),
        T,
        k,
        D,
        None if add is None else add.data_ptr(),
        out.data_ptr(),
    )
    return out
