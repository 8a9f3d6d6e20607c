"""DeepSeek-V4's stateless layer pieces on the torch path (rms norms, interleaved rope, mHC's
Sinkhorn step), written as transformers computes them; the model and its MTP drafter share them.
DeepSeek-V3 has none of these in common: its norms and rope run through the kernels' ops."""

from __future__ import annotations

from typing import Optional

import torch


def rms(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * y).to(x.dtype) if weight is not None else y.to(x.dtype)


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rope_table(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e^{i angle}, e^{-i angle}) [N, rope_dim / 2] complex64 at positions [N]: computed once per
    step and reused by every layer (the angles depend only on the positions)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cis = torch.polar(torch.ones_like(freqs), freqs)
    return cis, cis.conj().resolve_conj()


def apply_rope(
    x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor], conj: bool = False, inplace: bool = False
) -> torch.Tensor:
    """Interleaved rope on the trailing rope slice of x [N, ..., dim] with a `rope_table`: each
    (even, odd) pair is a complex number turned by the angle, one complex multiply (in fp32).
    conj rotates by -angle (undoes the rope that values picked up, at the query position).
    inplace: x is a fresh tensor of the caller's; only its rope slice is written."""
    cis = table[1] if conj else table[0]
    while cis.dim() < x.dim():
        cis = cis.unsqueeze(1)
    rd = 2 * cis.shape[-1]
    pairs = x[..., -rd:].float().unflatten(-1, (-1, 2))
    if inplace and ROPE_IN_PLACE and pairs.dtype == x.dtype and _pair_aligned(pairs):
        # fp32: multiply x's own pairs as complex numbers, the same kernel without the copies back
        torch.view_as_complex(pairs).mul_(cis)
        return x
    if not _pair_aligned(pairs):
        pairs = pairs.contiguous()  # a complex view needs pair-aligned strides
    rotated = torch.view_as_real(torch.view_as_complex(pairs) * cis).flatten(-2).to(x.dtype)
    if inplace:
        x[..., -rd:] = rotated
        return x
    return torch.cat([x[..., :-rd], rotated], dim=-1)


ROPE_IN_PLACE = True  # bench/ab_v4_step.py's "before" turns it off


def _pair_aligned(pairs: torch.Tensor) -> bool:
    return pairs.storage_offset() % 2 == 0 and all(st % 2 == 0 for st in pairs.stride()[:-1])


def rope_at(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, conj: bool = False) -> torch.Tensor:
    return apply_rope(x, rope_table(positions, inv_freq), conj)


def sinkhorn_(comb: torch.Tensor, iters: int, eps: float) -> None:
    """Sinkhorn normalisation of [T, hc, hc] mixing matrices in place: columns, then rows and
    columns again `iters - 1` times. ~120 tiny ops per call: on the CPU they run on the same
    memory through numpy, several times faster than torch's per-op dispatch (same float32 math)."""
    c = comb.numpy() if comb.device.type == "cpu" else comb
    c /= c.sum(-2, keepdims=True) + eps
    for _ in range(iters - 1):
        c /= c.sum(-1, keepdims=True) + eps
        c /= c.sum(-2, keepdims=True) + eps
