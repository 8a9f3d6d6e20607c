"""The kernel API on the CPU (`--kernel-backend cpu`, the default on a CPU device): the C kernels
(dsv4_kernels.cpu_*, built by dsv4_kernels.native) where they apply, the torch reference where
not. Each op decides per call (an fp32 CPU tensor of a supported layout, few enough tokens, a
library that built), so a model calls one op and never learns which form ran;
`implementations()` says which runs for each op and why."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from dsv4_kernels import (
    cpu_grouped_moe,
    cpu_mhc,
    cpu_mla,
    cpu_mla_absorb,
    cpu_moe,
    cpu_moe_route,
    cpu_rmsnorm,
    cpu_rope,
    cpu_v4_attention,
    cpu_v4_compress,
    native,
)
from dsv4_kernels.grouped_moe import grouped_experts
from dsv4_kernels.ops_torch import OP_GROUPS, TorchOps
from dsv4_kernels.reference import silu_mul

# Which native library serves each op group, by its module and csrc name (None: the reference
# always runs on this backend).
_LIBRARIES = {
    "rmsnorm": (cpu_rmsnorm, "rmsnorm_cpu"),
    "rope": (cpu_rope, "rope_cpu"),
    "linear": (cpu_moe, "cpu_moe"),
    "mlp": (cpu_moe, "cpu_moe"),
    "mla_absorb": (cpu_mla_absorb, "mla_absorb_cpu"),
    "mla_decode": (cpu_mla, "mla_decode_cpu"),
    "mla_extend": None,
    "moe_route": (cpu_moe_route, "moe_route_cpu"),
    "moe_experts": (cpu_grouped_moe, "grouped_moe_cpu"),
    "v4_attention": (cpu_v4_attention, "v4_attn_cpu"),
    "v4_rms_rope": (cpu_v4_attention, "v4_attn_cpu"),
    "v4_compress": (cpu_v4_compress, "v4_compress_cpu"),
    "v4_indexer": None,
    "v4_mhc": (cpu_mhc, "v4_mhc_cpu"),
    "v4_moe": (cpu_moe, "cpu_moe"),
    "quant_linear": None,
}
# Heads x head_dim up to which V4's window attention runs natively: at 256 (v4-tiny, 32
# requests) a decode layer 0.42 -> 0.12 ms; at 32,768 (V4-Flash) MKL's GEMMs still win (4.2
# against 5.1 ms at 8 requests), so wide models keep the torch form.
V4_ATTN_MAX_WIDTH = 4096


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """grouped_experts' activation: fp32 on the CPU one native pass into a scratch buffer that the
    next call reuses (the down GEMMs consume it at once), else the reference's."""
    if cpu_grouped_moe.supports(gate_up) and gate_up.stride(1) == 1:
        n, inter = gate_up.shape[0], gate_up.shape[1] // 2
        return cpu_grouped_moe.swiglu(gate_up, cpu_grouped_moe.scratch("moe_h", n, inter))
    return silu_mul(gate_up)


class CpuOps(TorchOps):
    name = "cpu"
    grouped_passes = cpu_grouped_moe

    def __init__(self) -> None:
        # each library's build is tried once, here: a per-call check reads a bool
        self._on = {lib[0]: lib[0].available() for lib in _LIBRARIES.values() if lib is not None}

    # ---- V3 --------------------------------------------------------------------------------
    def rmsnorm(self, x, weight, eps, residual=None):
        if self._on[cpu_rmsnorm] and cpu_rmsnorm.supports(x, weight, residual):
            return cpu_rmsnorm.rmsnorm(x, weight, eps, residual)
        return super().rmsnorm(x, weight, eps, residual)

    def rope_interleaved_(self, x, positions, cos, sin):
        if self._on[cpu_rope] and cpu_rope.supports(x, positions, cos, sin):
            return cpu_rope.rope_interleaved_(x, positions, cos, sin)
        return super().rope_interleaved_(x, positions, cos, sin)

    def linear(self, x, w):
        if cpu_moe.applies_linear(x, w):  # a decode step's few tokens: the weights streamed once
            return cpu_moe.linear(x, w)
        return F.linear(x, w)

    def mlp(self, x, w13, w2):
        if cpu_moe.applies(x, w13, w2):  # a decode step's few tokens: one native call
            return cpu_moe.mlp(x, w13, w2)
        if cpu_grouped_moe.supports(x, w13, w2):  # prefill widths: one-pass SwiGLU, reused scratch
            return cpu_grouped_moe.mlp(x, w13, w2)
        return super().mlp(x, w13, w2)

    def moe_experts(self, x, w13, w2, topk_weights, topk_ids, add=None):
        """The reference's grouped experts with the native gather, SwiGLU and combine passes."""
        run = (x, w13, w2, topk_weights, topk_ids, _silu_mul)
        if add is not None and x.dtype != torch.float32:
            return grouped_experts(*run, passes=cpu_grouped_moe).to(x.dtype) + add
        return grouped_experts(*run, add=add, passes=cpu_grouped_moe).to(x.dtype)

    def moe_block(self, x, w13, w2, weights, ids, shared, experts: Callable):
        if cpu_moe.applies(x, w13, w2, *(shared or (None, None))):
            # routed and shared experts in one call that reads each used expert's weights once
            return cpu_moe.experts(x, w13, w2, weights, ids, shared)
        if shared is not None and cpu_grouped_moe.supports(x, w13, w2, *shared):
            # the shared expert's output joins the routed top-k sum's pass (routed sum, then shared)
            s = cpu_grouped_moe.mlp(x, *shared, out_scratch="shared_out")
            return self.moe_experts(x, w13, w2, weights, ids, add=s)
        return super().moe_block(x, w13, w2, weights, ids, shared, experts)

    def mla_absorb_weights(self, w_uk, w_uv):
        if not self._on[cpu_mla_absorb]:
            return {}
        # [H, C, v] for the native pass (its axpy form): a second copy of W_UV, as the per-head
        # prefill lifts through w_uv viewed [H * v, C]; W_UK packed to be read in order
        extra = {"w_uvt": w_uv.transpose(1, 2).contiguous()}
        packed = cpu_mla_absorb.pack_w_uk(w_uk)
        if packed is not None:
            extra["w_uk_packed"] = packed
        return extra

    def mla_absorb_q(self, q, w_uk, extra):
        if "w_uvt" in extra and cpu_mla_absorb.supports(q, w_uk, extra["w_uvt"]):
            return cpu_mla_absorb.absorb_q(q, w_uk, extra.get("w_uk_packed"))
        return super().mla_absorb_q(q, w_uk, extra)

    def mla_lift_v(self, o, dtype, w_uv, extra):
        w_uvt = extra.get("w_uvt")
        if w_uvt is not None and dtype == o.dtype == torch.float32 and o.stride(2) == 1 and o.device.type == "cpu":
            return cpu_mla_absorb.apply_uv(o, w_uvt).transpose(0, 1)
        return super().mla_lift_v(o, dtype, w_uv, extra)

    def mla_decode(self, q, kv_cache, block_table, seq_lens, scale, v_dim, *args, **kwargs):
        if self._on[cpu_mla] and cpu_mla.supports(q, kv_cache):
            return cpu_mla.mla_decode(q, kv_cache, block_table, seq_lens, scale, v_dim, *args, **kwargs)
        return super().mla_decode(q, kv_cache, block_table, seq_lens, scale, v_dim, *args, **kwargs)

    def moe_route(self, logits, bias, *args):
        if self._on[cpu_moe_route] and cpu_moe_route.supports(logits, bias):  # ties fall back inside
            return cpu_moe_route.moe_route(logits, bias, *args)
        return super().moe_route(logits, bias, *args)

    # ---- V4's torch path ------------------------------------------------------------------------
    def v4_hc_pre_tail(self, mixes, base, scale, x, hc_eps, iters):
        if self._on[cpu_mhc] and x.device.type == "cpu":
            return cpu_mhc.hc_pre_tail(mixes, base, scale, x, hc_eps, iters)
        return super().v4_hc_pre_tail(mixes, base, scale, x, hc_eps, iters)

    def v4_hc_mix(self, x, out, post, comb):
        if self._on[cpu_mhc] and x.dtype == out.dtype == torch.float32 and x.device.type == "cpu":
            return cpu_mhc.hc_post(x, out, post, comb)
        return super().v4_hc_mix(x, out, post, comb)

    def v4_rms_rope(self, x, weight, eps, table, norm=True, conj=False, inplace=False):
        if (
            self._on[cpu_v4_attention]
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and x.stride(-1) == 1
            and (not inplace or x.is_contiguous())
        ):
            cis = None if table is None else table[0]
            return cpu_v4_attention.rms_rope(x, weight, eps, cis, norm=norm, conj=conj, out=x if inplace else None)
        return super().v4_rms_rope(x, weight, eps, table, norm, conj, inplace)

    def v4_pool_windows(self, win, prev, w_ids, params, rate, eps, inv_freq):
        if self._on[cpu_v4_compress] and win.dtype == torch.float32 and win.device.type == "cpu":
            _, _, ape, norm_w = params
            return cpu_v4_compress.pool_windows(win, prev, w_ids, ape, norm_w, eps, inv_freq, rate).to(win.dtype)
        return None

    def v4_moe_block(self, x, w13, w2, weights, ids, shared, swiglu_limit):
        if cpu_moe.applies(x, w13, w2, *(shared or (None, None))):
            return cpu_moe.experts(x, w13, w2, weights, ids, shared, swiglu_limit)
        return super().v4_moe_block(x, w13, w2, weights, ids, shared, swiglu_limit)

    def v4_native_attention(self, width: int, dtype: torch.dtype) -> bool:
        return self._on[cpu_v4_attention] and dtype == torch.float32 and width <= V4_ATTN_MAX_WIDTH

    v4_attend_decode = staticmethod(cpu_v4_attention.decode)
    v4_attend_extend = staticmethod(cpu_v4_attention.extend)

    # ---- what runs ---------------------------------------------------------------------------
    def build_failures(self) -> int:
        names = {lib[1] for lib in _LIBRARIES.values() if lib is not None and not self._on[lib[0]]}
        return sum(native.why_not(n).startswith("native build failed") for n in names)

    def implementations(self) -> dict[str, str]:
        out = {}
        for op in OP_GROUPS:
            lib = _LIBRARIES[op]
            if lib is None:
                out[op] = "cpu: reference (no native kernel)"
            elif self._on[lib[0]]:
                out[op] = "cpu: native"
            else:
                out[op] = f"cpu: reference ({native.why_not(lib[1])})"
        return out
