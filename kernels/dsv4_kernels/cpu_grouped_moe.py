"""The passes around a prefill-sized MoE's GEMMs on the CPU as native calls (csrc/grouped_moe_cpu.c):
the pairs' row gather, the SwiGLU silu(gate) * up in one pass, and the top-k combine (weight,
sum over k, plus the shared expert's output) in one pass. At a 1048-token step the torch forms
of these were ~6 ms a layer around ~20 ms of GEMMs (dsv4_kernels.grouped_moe).

`combine` is bit for bit the torch form's sum; `swiglu` differs from torch's silu by rounding
(its own exp). fp32 CPU tensors only.

The intermediates (gathered rows, gate_up, h, expert outputs) live in per-thread scratch buffers
kept between calls: a fresh multi-MB torch.empty is fresh pages from the kernel, and on the VM
measured each 4 KiB page's first touch cost ~2 us, ~5000 of them a 1048-token MoE layer (~10 ms
beside ~30 ms of GEMMs). Built with the system C compiler at first use
(dsv4_kernels.native); where no compiler works, or DSV4_NO_NATIVE_GROUPED_MOE=1 or
DSV4_NO_NATIVE=1, `available()` is False and callers keep the torch forms."""

from __future__ import annotations

import ctypes
import threading
from typing import Optional

import torch

import dsv4_kernels.native as native  # not via the package, whose get_ops imports reference
from dsv4_kernels.native import I64, P

_lib: Optional[ctypes.CDLL] = None

# Scratch buffers larger than this many floats are not kept (a long prefill chunk's): the pages
# are still fresh each call there, but the memory held between calls stays bounded.
MAX_SCRATCH = 1 << 22
_tls = threading.local()


def scratch(name: str, rows: int, cols: int) -> torch.Tensor:
    """A [rows, cols] fp32 buffer of this thread's that `name` reuses from call to call (its
    contents are garbage). Two names never share memory; a caller must be done with one before
    asking for the same name again."""
    n = rows * cols
    if n > MAX_SCRATCH:
        return torch.empty(rows, cols, dtype=torch.float32)
    pool = getattr(_tls, "pool", None)
    if pool is None:
        pool = _tls.pool = {}
    # a buffer made under inference_mode cannot be written outside it: one set for each mode
    key = (name, torch.is_inference_mode_enabled())
    buf = pool.get(key)
    if buf is None or buf.numel() < n:
        buf = pool[key] = torch.empty(n, dtype=torch.float32)
    return buf[:n].view(rows, cols)


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
    """Whether these (activations, weights) are fp32 CPU tensors and the build is here, and no
    gradient is wanted through them: the native passes and the out= matmuls are not
    differentiable (training's forward keeps the torch form)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return all(_f32(t) for t in tensors) and available()


def gather_rows(x: torch.Tensor, rows: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x[rows] for x [T, D] with contiguous channels, rows int64 [n] in [0, T); into `out`
    (contiguous [n, D]) when given."""
    assert _lib is not None, "call available() first"
    n, D = rows.shape[0], x.shape[1]
    assert x.stride(1) == 1 and rows.dtype == torch.int64 and rows.is_contiguous()
    out = torch.empty(n, D, dtype=torch.float32) if out is None else out
    assert out.is_contiguous() and out.shape == (n, D)
    _lib.gather_rows(x.data_ptr(), x.stride(0), rows.data_ptr(), n, D, out.data_ptr())
    return out


def swiglu(gate_up: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """silu(gate_up[:, :I]) * gate_up[:, I:] as [n, I] (gate_up [n, 2I], contiguous channels);
    into `out` (contiguous [n, I]) when given."""
    assert _lib is not None, "call available() first"
    n, I2 = gate_up.shape
    assert gate_up.stride(1) == 1 and I2 % 2 == 0
    h = torch.empty(n, I2 // 2, dtype=torch.float32) if out is None else out
    assert h.is_contiguous() and h.shape == (n, I2 // 2)
    _lib.swiglu_rows(gate_up.data_ptr(), n, I2 // 2, gate_up.stride(0), h.data_ptr())
    return h


def mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, out_scratch: str = "") -> torch.Tensor:
    """A dense SwiGLU MLP w2 @ (silu(gate x) * (up x)) (w13 [2I, D], w2 [D, I]): the same GEMMs
    as F.linear's (same bits), gate_up and h in scratch, the result in a new tensor or, with
    `out_scratch`, in that scratch buffer (for a caller that consumes it at once)."""
    T = x.shape[0]
    gate_up = torch.mm(x, w13.t(), out=scratch("mlp_gate_up", T, w13.shape[0]))
    h = swiglu(gate_up, scratch("mlp_h", T, w13.shape[0] // 2))
    if not out_scratch:
        return torch.mm(h, w2.t())
    return torch.mm(h, w2.t(), out=scratch(out_scratch, T, w2.shape[0]))


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
