"""DeepSeek-V4's mHC pre step on the CPU as one native call (csrc/v4_mhc_cpu.c): everything after
the mixing linear (sigmoids, the comb softmax, the Sinkhorn rounds and the collapse of the
streams) for the whole batch, instead of ~15 torch ops and ~80 numpy ops per layer half.

The C file is built with the system C compiler at first use into the user's cache (no torch
headers, well under a second) and loaded with ctypes. Where no compiler works, or
DSV4_NO_NATIVE_MHC=1 or DSV4_NO_NATIVE=1 (dsv4_kernels.native), `available()` is False and the model keeps its torch form."""

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
            "v4_mhc_cpu",
            ["-ffp-contract=off"],
            off_env="DSV4_NO_NATIVE_MHC",
            signatures={
                "v4_hc_pre_tail": ([P, I64, P, P, P, I64, I64, I64, F32, I64, P, P, P], None),
                "v4_hc_post": ([P, P, P, P, I64, I64, I64, P], None),
            },
        )
    return _lib is not None


def hc_pre_tail(
    mixes: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    x: torch.Tensor,
    hc_eps: float,
    iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [T, (2 + hc) * hc] fp32 (the mixing linear's output), x [T, hc, D] ->
    (post [T, hc], comb [T, hc, hc], collapsed [T, D] in x's dtype), all on the CPU."""
    assert _lib is not None, "call available() first"
    T, hc, D = x.shape
    if hc > 16:
        raise ValueError(f"hc_mult {hc} > 16")
    mixes = mixes.float()
    if mixes.stride(1) != 1:
        mixes = mixes.contiguous()
    xf = x.float().contiguous()
    base, scale = base.float().contiguous(), scale.float().contiguous()
    post = torch.empty(T, hc, dtype=torch.float32)
    comb = torch.empty(T, hc, hc, dtype=torch.float32)
    collapsed = torch.empty(T, D, dtype=torch.float32)
    _lib.v4_hc_pre_tail(
        mixes.data_ptr(),
        mixes.stride(0),
        base.data_ptr(),
        scale.data_ptr(),
        xf.data_ptr(),
        T,
        hc,
        D,
        hc_eps,
        iters,
        post.data_ptr(),
        comb.data_ptr(),
        collapsed.data_ptr(),
    )
    return post, comb, collapsed.to(x.dtype)


def hc_post(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The mHC post step for fp32 on the CPU: x [T, hc, D] streams, out [T, D] the layer's output,
    post [T, hc], comb [T, hc, hc] -> [T, hc, D], stream k = post[k] * out + sum_j comb[j, k] * x[j]."""
    assert _lib is not None, "call available() first"
    T, hc, D = x.shape
    x, out = x.contiguous(), out.contiguous()
    post, comb = post.float().contiguous(), comb.float().contiguous()
    y = torch.empty(T, hc, D, dtype=torch.float32)
    _lib.v4_hc_post(x.data_ptr(), out.data_ptr(), post.data_ptr(), comb.data_ptr(), T, hc, D, y.data_ptr())
    return y
