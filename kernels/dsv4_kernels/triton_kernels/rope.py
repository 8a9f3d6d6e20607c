"""Interleaved rotary embedding applied in place: pair i = (x[2i], x[2i+1]) turns by the angle
whose cos/sin the engine precomputed at [position, i]; the result stays interleaved. One
program rotates BLOCK_H heads of one token, sharing that token's cos/sin row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import KernelVariant, check_launchable, next_pow2


@triton.jit
def rope_interleaved_kernel(
    x_ptr, positions_ptr, cos_ptr, sin_ptr,
    num_heads, stride_x_t, stride_x_h, stride_cos, stride_sin,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    i_mask = i < HALF
    c = tl.load(cos_ptr + pos * stride_cos + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * stride_sin + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    even = x_ptr + token * stride_x_t + heads[:, None] * stride_x_h + 2 * i[None, :]
    mask = (heads < num_heads)[:, None] & i_mask[None, :]
    a = tl.load(even, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(even + 1, mask=mask, other=0.0).to(tl.float32)
    tl.store(even, (a * c - b * s).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(even + 1, (a * s + b * c).to(x_ptr.dtype.element_ty), mask=mask)


def _block_h(num_heads: int) -> int:
    return min(16, next_pow2(num_heads))


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
    block_h = _block_h(num_heads)
    rope_interleaved_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        x, positions, cos, sin,
        num_heads, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
        HALF=rot // 2, BLOCK_H=block_h, BLOCK_HALF=next_pow2(rot // 2),
        num_warps=1 if block_h * rot <= 256 else 4,
    )
    return x


def aot_variants(arch: int) -> list[KernelVariant]:
    """DeepSeek-V3's rope width 64 over 128 heads, bf16."""
    return [KernelVariant(
        name="rope_interleaved[bf16,r64]",
        kernel=rope_interleaved_kernel,
        types={
            "x_ptr": "*bf16", "positions_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
            "num_heads": "i32", "stride_x_t": "i32", "stride_x_h": "i32", "stride_cos": "i32", "stride_sin": "i32",
        },
        constexprs=dict(HALF=32, BLOCK_H=_block_h(128), BLOCK_HALF=32),
        num_warps=4, num_stages=1,
    )]
