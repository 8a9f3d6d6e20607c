"""Interleaved rotary embedding applied in place: pair i = (x[2i], x[2i+1]) turns by the angle
whose cos/sin the engine precomputed at [position, i]; the result stays interleaved. A program
rotates BLOCK_T tokens x BLOCK_H heads, each token's cos/sin row loaded once for its heads."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import KernelVariant, check_launchable, next_pow2, fp32_twins


@triton.jit
def rope_interleaved_kernel(
    x_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    num_tokens,
    num_heads,
    stride_x_t,
    stride_x_h,
    stride_cos,
    stride_sin,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    t_mask = tokens < num_tokens
    i_mask = i < HALF
    pos = tl.load(positions_ptr + tokens, mask=t_mask, other=0).to(tl.int64)
    cs_mask = t_mask[:, None] & i_mask[None, :]
    c = tl.load(cos_ptr + pos[:, None] * stride_cos + i[None, :], mask=cs_mask, other=0.0).to(tl.float32)[:, None, :]
    s = tl.load(sin_ptr + pos[:, None] * stride_sin + i[None, :], mask=cs_mask, other=0.0).to(tl.float32)[:, None, :]
    even = (
        x_ptr
        + tokens.to(tl.int64)[:, None, None] * stride_x_t
        + heads[None, :, None] * stride_x_h
        + 2 * i[None, None, :]
    )
    mask = t_mask[:, None, None] & (heads < num_heads)[None, :, None] & i_mask[None, None, :]
    a = tl.load(even, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(even + 1, mask=mask, other=0.0).to(tl.float32)
    tl.store(even, (a * c - b * s).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(even + 1, (a * s + b * c).to(x_ptr.dtype.element_ty), mask=mask)


def _tiles(num_heads: int, half: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_H, BLOCK_HALF): up to 16 heads, and tokens to make ~2k pairs a program."""
    block_h = min(16, next_pow2(num_heads))
    block_half = next_pow2(half)
    return max(1, 2048 // (block_h * block_half)), block_h, block_half


def rope_interleaved_(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    check_launchable(rope_interleaved_kernel, x)
    num_tokens, num_heads, rot = x.shape
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rope_interleaved_ needs the last dim of x, cos and sin contiguous")
    if num_tokens == 0:
        return x
    block_t, block_h, block_half = _tiles(num_heads, rot // 2)
    rope_interleaved_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(num_heads, block_h))](
        x,
        positions,
        cos,
        sin,
        num_tokens,
        num_heads,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        sin.stride(0),
        HALF=rot // 2,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        num_warps=4,
    )
    return x


def aot_variants(arch: int) -> list[KernelVariant]:
    """DeepSeek-V3's rope width 64 over 128 heads, bf16."""
    block_t, block_h, block_half = _tiles(128, 32)
    return fp32_twins(
        [
            KernelVariant(
                name="rope_interleaved[bf16,r64]",
                kernel=rope_interleaved_kernel,
                types={
                    "x_ptr": "*bf16",
                    "positions_ptr": "*i64",
                    "cos_ptr": "*fp32",
                    "sin_ptr": "*fp32",
                    "num_tokens": "i32",
                    "num_heads": "i32",
                    "stride_x_t": "i32",
                    "stride_x_h": "i32",
                    "stride_cos": "i32",
                    "stride_sin": "i32",
                },
                constexprs=dict(HALF=32, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_HALF=block_half),
                num_warps=4,
                num_stages=1,
            )
        ]
    )
