"""FP8 block-scaled and FP4 (e2m1, power-of-two scales) encodings: quantize, dequantize, pack.

FP8 (DeepSeek-V3's release): e4m3 weights [N, K] and one fp32 `weight_scale_inv` per 128x128
block ([ceil(N/128), ceil(K/128)], the edge blocks partial); value = q * scale_inv.
FP4 (DeepSeek-V4's routed experts, as transformers' finegrained_fp8 integration reads them): e2m1
codes packed two per byte along K (element 2j in the low nibble, 2j+1 in the high one), stored as
int8 [N, K/2], and one power-of-two scale per 32 values of a row ([N, K/32], ue8m0: byte e means
2**(e-127)); value = e2m1(code) * scale. That is the OCP MX layout (MXFP4) along rows.
"""

from __future__ import annotations

import torch

from dsv4_engine.quant.scheme import cdiv  # defined where the torch-free header checks need it
from dsv4_kernels.reference_quant import (
    E2M1_VALUES,
    FP8_MAX,
    dequantize_fp4,
    dequantize_fp8_rows,
    e8m0_to_float,
    unpack_fp4,
)

FP4_MAX = 6.0


# ---- scales ----------------------------------------------------------------------------------------


def float_to_e8m0_bytes(s: torch.Tensor) -> torch.Tensor:
    """Exact powers of two (fp32) -> exponent bytes (uint8)."""
    e = torch.log2(s.float()).round()
    return (e + 127).clamp(0, 254).to(torch.uint8)


def scale_as_float(s: torch.Tensor) -> torch.Tensor:
    if s.dtype in (torch.uint8, getattr(torch, "float8_e8m0fnu", None)):
        return e8m0_to_float(s)
    return s.float()


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(x.clamp(min=torch.finfo(torch.float32).tiny))))


# ---- fp8 block ---------------------------------------------------------------------------------


def quantize_fp8_block(
    w: torch.Tensor, block: tuple[int, int] = (128, 128), pow2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (e4m3 [N, K], fp32 scale_inv [ceil(N/bn), ceil(K/bk)]). pow2 rounds each
    scale up to a power of two (ue8m0 storage) so that it is stored exactly."""
    N, K = w.shape
    bn, bk = block
    nb, kb = cdiv(N, bn), cdiv(K, bk)
    padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32)
    padded[:N, :K] = w.float()
    tiles = padded.view(nb, bn, kb, bk)
    amax = tiles.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    if pow2:
        scale_inv = _pow2_ceil(scale_inv)
    q = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(nb * bn, kb * bk)[:N, :K].contiguous(), scale_inv.contiguous()


def expand_block_scale(scale_inv: torch.Tensor, n: int, bn: int) -> torch.Tensor:
    """Block scales [..., ceil(N/bn), Kb] -> one row of scales per weight row [..., N, Kb]."""
    return scale_inv.repeat_interleave(bn, dim=-2)[..., :n, :].contiguous()


def dequantize_fp8_block(
    q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128), dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return dequantize_fp8_rows(q, expand_block_scale(scale_as_float(scale_inv), q.shape[-2], block[0]), block[1], dtype)


# ---- fp4 (e2m1) ----------------------------------------------------------------------------------


def quantize_fp4(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float (K a multiple of group) -> (packed int8 [N, K/2], e8m0 exponent bytes
    uint8 [N, K/group]). Each group's scale is the smallest power of two that brings its largest
    magnitude to <= 6 (no clipping); values round to the nearest e2m1 magnitude (ties to the
    smaller one)."""
    N, K = w.shape
    if K % group:
        raise ValueError(f"fp4 needs K a multiple of {group}, got {K}")
    g = w.float().view(N, K // group, group)
    amax = g.abs().amax(dim=-1)
    scale = torch.where(amax > 0, _pow2_ceil(amax / FP4_MAX), torch.ones_like(amax))
    v = g / scale[..., None]
    grid = torch.tensor(E2M1_VALUES)
    idx = (v.abs()[..., None] - grid).abs().argmin(dim=-1)  # first minimum: ties go to the smaller magnitude
    codes = (idx | ((v < 0) & (idx > 0)).long() << 3).view(N, K).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8).contiguous(), float_to_e8m0_bytes(scale).contiguous()


def fp8_bytes_per_param(group: int = 128) -> float:
    """Resident bytes per weight value on GPU: e4m3 + its fp32 per-row scale per group."""
    return 1 + 4 / group


def fp4_bytes_per_param(group: int = 32) -> float:
    return 0.5 + 1 / group


__all__ = [
    "FP8_MAX",
    "E2M1_VALUES",
    "cdiv",
    "quantize_fp8_block",
    "dequantize_fp8_block",
    "dequantize_fp8_rows",
    "expand_block_scale",
    "quantize_fp4",
    "unpack_fp4",
    "dequantize_fp4",
    "e8m0_to_float",
    "float_to_e8m0_bytes",
    "scale_as_float",
]
