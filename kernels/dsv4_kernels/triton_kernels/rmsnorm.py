"""RMSNorm with a fused residual add, rounded like HF's DeepseekV3RMSNorm: the sum
x + residual is rounded to the input dtype (that is the residual the next layer sees), and the
normalised row is rounded to the input dtype before the weight multiply.

A program normalises ROWS rows of up to BLOCK columns: one row at DeepSeek-V3's 7168, several
at narrow widths (the 512-wide latent norm), so small rows still fill a program."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import KernelVariant, check_launchable, next_pow2, fp32_twins


@triton.jit
def rmsnorm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    num_rows,
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (cols < hidden)[None, :]
    h = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + rows[:, None] * stride_ro + cols[None, :], h, mask=mask)
    h32 = h.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(h32 * h32, 1) / hidden + eps)
    normed = (h32 * inv_rms[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    out = (normed * w[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], out, mask=mask)


def _tiles(hidden: int) -> tuple[int, int, int]:
    """(ROWS, BLOCK, num_warps): about 4k elements a program, 16 warps at most."""
    block = next_pow2(hidden)
    rows = max(1, 4096 // block)
    return rows, block, max(1, min(16, rows * block // 256))


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
    num_rows = x2.shape[0]
    if num_rows:
        rows, block, warps = _tiles(hidden)
        rmsnorm_kernel[(triton.cdiv(num_rows, rows),)](
            x2,
            res2,
            weight.contiguous(),
            out,
            res_out,
            num_rows,
            hidden,
            float(eps),
            x2.stride(0),
            res2.stride(0),
            out.stride(0),
            res_out.stride(0),
            HAS_RESIDUAL=residual is not None,
            ROWS=rows,
            BLOCK=block,
            num_warps=warps,
        )
    if residual is None:
        return out.view(x.shape), x
    return out.view(x.shape), res_out.view(x.shape)


def aot_variants(arch: int) -> list[KernelVariant]:
    """bf16 at DeepSeek-V3's hidden size 7168 with and without the residual, and at the
    512-wide latent (several rows a program)."""
    variants = []
    for hidden, has_residual in ((7168, True), (7168, False), (512, False)):
        rows, block, warps = _tiles(hidden)
        variants.append(
            KernelVariant(
                name=f"rmsnorm[bf16,{hidden},{'residual' if has_residual else 'plain'}]",
                kernel=rmsnorm_kernel,
                types={
                    "x_ptr": "*bf16",
                    "residual_ptr": "*bf16",
                    "weight_ptr": "*bf16",
                    "out_ptr": "*bf16",
                    "residual_out_ptr": "*bf16",
                    "num_rows": "i32",
                    "hidden": "i32",
                    "eps": "fp32",
                    "stride_x": "i32",
                    "stride_r": "i32",
                    "stride_o": "i32",
                    "stride_ro": "i32",
                },
                constexprs=dict(HAS_RESIDUAL=has_residual, ROWS=rows, BLOCK=block),
                divisible=("hidden",),
                num_warps=warps,
                num_stages=1,
            )
        )
    return fp32_twins(variants)
