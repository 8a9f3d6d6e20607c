"""DeepSeek-V4's compressor pooling on the CPU as one native call (csrc/v4_compress_cpu.c): every
window closing in a layer pooled, normed and roped at once, instead of ~25 torch ops per call.
fp32 only; where native code cannot run (dsv4_kernels.native) or DSV4_NO_NATIVE_V4_COMPRESS=1,
`available()` is False and the model keeps its torch form."""

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
            "v4_compress_cpu",
            ["-ffp-contract=off"],
            off_env="DSV4_NO_NATIVE_V4_COMPRESS",
            signatures={
                "v4_pool_windows": ([P, P, P, P, I64, I64, P, I64, I64, I64, I64, P, I64, P, F32, P, I64, P], None),
            },
        )
    return _lib is not None


def pool_windows(
    win: torch.Tensor,
    prev: Optional[torch.Tensor],
    w_ids: torch.Tensor,
    ape: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
    rate: int,
) -> torch.Tensor:
    """win, prev [N, rate, 2 * width] fp32 stage rows ([kv | gate]) of the closing windows and,
    for the overlapping compressor, of the windows before them; w_ids [N]. -> entries [N, hd]
    (hd = width / 2 with prev, else width), pooled, normed and roped at w * rate."""
    assert _lib is not None, "call available() first"
    N, r, two_w = win.shape
    width = two_w // 2
    overlap = prev is not None
    hd = width // 2 if overlap else width
    win = win.contiguous()
    prev = prev.contiguous() if overlap else win
    assert win.dtype == prev.dtype == torch.float32 and r == rate
    w_ids = w_ids.long().contiguous()
    ape, norm_w, inv_freq = ape.float().contiguous(), norm_w.float().contiguous(), inv_freq.float().contiguous()
    out = torch.empty(N, hd, dtype=torch.float32)
    if N:
        base, pbase = win.data_ptr(), prev.data_ptr()
        _lib.v4_pool_windows(
            base,
            base + 4 * width,
            pbase,
            pbase + 4 * width,
            rate * two_w,
            two_w,
            w_ids.data_ptr(),
            N,
            rate,
            hd,
            int(overlap),
            ape.data_ptr(),
            width,
            norm_w.data_ptr(),
            eps,
            inv_freq.data_ptr(),
            inv_freq.shape[0],
            out.data_ptr(),
        )
    return out
