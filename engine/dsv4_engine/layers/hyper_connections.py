"""Manifold-constrained hyper-connections (mHC): DeepSeek-V4's residual of `hc_mult` streams.

Before a sublayer the streams collapse to one input by learned, input-dependent weights (`pre`);
after it the output is written back to every stream (`post`) and the streams are mixed by a
doubly-stochastic matrix (`comb`, from Sinkhorn iterations). The head collapses the streams once
more before the final norm (`HyperHead`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4_engine.layers.v4_step import V4Backend


class HyperConnection:
    """One sublayer's mHC: fn [(2 + hc) * hc, hc * D], base, scale (fp32, as in the release)."""

    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, backend: V4Backend):
        self.fn, self.base, self.scale = fn, base, scale
        self.backend = backend

    def collapse(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Streams x [T, hc, D] -> (post [T, hc], comb [T, hc, hc], the sublayer's input [T, D])."""
        cfg, kops = self.backend.cfg, self.backend.kops
        if kops is not None:
            return kops.v4_hc_pre(
                x, self.fn, self.base, self.scale, cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters
            )
        flat = x.reshape(x.shape[0], -1).float()
        # rms by a norm: one reduction, no squared copy of the streams
        ms = torch.linalg.vector_norm(flat, dim=-1, keepdim=True).square_().div_(flat.shape[-1])
        mixes = F.linear(flat * ms.add_(cfg.rms_norm_eps).rsqrt_(), self.fn)
        return self.backend.ops.v4_hc_pre_tail(mixes, self.base, self.scale, x, cfg.hc_eps, cfg.hc_sinkhorn_iters)

    def expand(self, x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The streams after the sublayer: stream k gets post[k] * out + sum_j comb[j, k] * x[j]."""
        kops = self.backend.kops
        if kops is not None:
            return kops.v4_hc_post(x, out, post, comb)
        return self.backend.ops.v4_hc_mix(x, out, post, comb)


class HyperHead:
    """The streams [N, hc, D] collapsed to one hidden state [N, D] before the final norm."""

    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, backend: V4Backend):
        self.fn, self.base, self.scale = fn, base, scale
        self.backend = backend

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.backend.cfg
        flat = self.backend.ops.unweighted_rms(x.flatten(1).float(), cfg.rms_norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.fn) * self.scale + self.base) + cfg.hc_eps
        return (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
