"""RMSNorm with a fused residual add, one row per program, rounded like HF's DeepseekV3RMSNorm:
the sum x + residual is rounded to the input dtype (that is the residual the next layer sees),
the normalised row is rounded to the input dtype before the weight multiply."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import KernelVariant, check_launchable, next_pow2


@triton.jit
def rmsnorm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    hidden, eps,
    stride_x, stride_r, stride_o, stride_ro,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    h = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + offs, h, mask=mask)
    h32 = h.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(h32 * h32, 0) / hidden + eps)
    normed = (h32 * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _num_warps(block: int) -> int:
    return max(1, min(16, block // 256))


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_launchable(rmsnorm_kernel, x)
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        res2 = res_out = x2  # unused by the kernel when HAS_RESIDUAL is False
    else:
        res2 = residual.reshape(-1, hidden)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
        res_out = torch.empty_like(out)
    if x2.shape[0]:
        block = next_pow2(hidden)
        rmsnorm_kernel[(x2.shape[0],)](
            x2, res2, weight.contiguous(), out, res_out,
            hidden, float(eps),
            x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=_num_warps(block),
        )
    if residual is None:
        return out.view(x.shape), x
    return out.view(x.shape), res_out.view(x.shape)


def aot_variants(arch: int) -> list[KernelVariant]:
    """DeepSeek-V3's hidden size 7168, bf16, with and without the residual."""
    variants = []
    for has_residual in (True, False):
        variants.append(KernelVariant(
            name=f"rmsnorm[bf16,7168,{'residual' if has_residual else 'plain'}]",
            kernel=rmsnorm_kernel,
            types={
                "x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*bf16",
                "residual_out_ptr": "*bf16", "hidden": "i32", "eps": "fp32",
                "stride_x": "i32", "stride_r": "i32", "stride_o": "i32", "stride_ro": "i32",
            },
            constexprs=dict(HAS_RESIDUAL=has_residual, BLOCK=8192),
            divisible=("hidden",),
            num_warps=_num_warps(8192), num_stages=1,
        ))
    return variants
