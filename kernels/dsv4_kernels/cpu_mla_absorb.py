"""The per-head projections around absorbed-MLA attention on the CPU as native calls
(csrc/mla_absorb_cpu.c): the query into latent space with its rope part beside it (what the
attention kernels take), and the attention's latent output to per-head values. The torch form is
a bmm, a transpose and a cat before attention and a bmm, a transpose and a reshape copy after it:
at decode sizes those ops cost more than their multiply-adds.

Where no compiler works, or DSV4_NO_NATIVE_ABSORB=1 or DSV4_NO_NATIVE=1, `available()` is False
and callers keep the torch form."""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from dsv4_kernels import native
from dsv4_kernels.native import I32, I64, P

_lib: Optional[ctypes.CDLL] = None


def available() -> bool:
    global _lib
    if _lib is None:
        _lib = native.load(
            "mla_absorb_cpu",
            ["-march=native"],
            off_env="DSV4_NO_NATIVE_ABSORB",
            signatures={
                "absorb_q": ([P, I64, I64, I64, I64, I64, I64, P, I64, I32, P], None),
                "apply_uv": ([P, I64, I64, I64, I64, I64, P, I64, P], None),
            },
        )
    return _lib is not None


def _f32_cpu(*ts: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in ts)


def supports(q: torch.Tensor, w_uk: torch.Tensor, w_uvt: torch.Tensor) -> bool:
    """fp32 CPU q [T, H, N + R] with contiguous channels, w_uk [H, N, C] and w_uvt [H, C, V]
    contiguous."""
    return (
        _f32_cpu(q, w_uk, w_uvt)
        and q.dim() == 3
        and q.stride(2) == 1
        and w_uk.dim() == 3
        and w_uk.is_contiguous()
        and w_uvt.dim() == 3
        and w_uvt.is_contiguous()
        and w_uk.shape[0] == w_uvt.shape[0] == q.shape[1]
        and w_uk.shape[1] < q.shape[2]
        and w_uk.shape[2] == w_uvt.shape[1]
    )


# columns per register tile of the C kernel: pack_w_uk's tile width
TILE = 64


def pack_w_uk(w_uk: torch.Tensor) -> Optional[torch.Tensor]:
    """w_uk [H, N, C] as absorb_q reads it fastest: [H, C / TILE, N, TILE], each tile's rows one
    after another (None where C is not a multiple of TILE, or is one tile, already that layout:
    absorb_q then reads w_uk itself)."""
    H, N, C = w_uk.shape
    if C % TILE or C == TILE:
        return None
    return w_uk.reshape(H, N, C // TILE, TILE).permute(0, 2, 1, 3).contiguous()


def absorb_q(q: torch.Tensor, w_uk: torch.Tensor, packed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[T, H, C + R]: q[:, :, :N] @ w_uk per head, then q's rope part q[:, :, N:] (the torch form:
    cat([bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1), q_rope], -1)). `packed`:
    pack_w_uk(w_uk), read instead of w_uk (the same products in the same order)."""
    assert _lib is not None, "call available() first"
    T, H, NR = q.shape
    _, N, C = w_uk.shape
    w = w_uk
    if packed is not None:
        assert packed.is_contiguous() and packed.shape == (H, C // TILE, N, TILE)
        w = packed
    out = torch.empty(T, H, C + NR - N, dtype=torch.float32)
    _lib.absorb_q(
        q.data_ptr(), T, H, N, NR - N, q.stride(0), q.stride(1), w.data_ptr(), C, packed is not None, out.data_ptr()
    )
    return out


def apply_uv(o: torch.Tensor, w_uvt: torch.Tensor) -> torch.Tensor:
    """[T, H, V]: o [T, H, C] (contiguous channels) @ w_uvt [H, C, V] per head (the torch form:
    bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1))."""
    assert _lib is not None, "call available() first"
    T, H, C = o.shape
    V = w_uvt.shape[2]
    assert o.stride(2) == 1 and o.dtype == torch.float32
    out = torch.empty(T, H, V, dtype=torch.float32)
    _lib.apply_uv(o.data_ptr(), T, H, C, o.stride(0), o.stride(1), w_uvt.data_ptr(), V, out.data_ptr())
    return out
