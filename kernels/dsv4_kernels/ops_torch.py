"""The kernel API the models call, backed by torch: the reference every other backend is tested
against (`--kernel-backend torch`).

A backend is an object whose methods are the ops (`ops.rmsnorm(...)`, `ops.mla_decode(...)`,
`ops.v4_hc_pre_tail(...)` ...). `TorchOps` defines every one in torch; `CpuOps`
(dsv4_kernels.ops_cpu) and `TritonOps` (dsv4_kernels.ops_triton) override the ones they run
themselves, and fall back to these where an op does not apply to a call (a shape, a dtype, a
native build that failed), so a model never asks which implementation runs. `implementations()`
says, per op, which one runs and why (the start-up log and /v1/loads show it).

Two kinds of methods: the kernel ops (names and signatures of dsv4_kernels.reference,
reference_v4 and reference_quant: the kernels' oracle), and the torch forms of the models' own
steps that a backend may run in one call (the dense MLP, V3's absorbed projections, V4's mHC
tail, norm + rope pass and compressor pooling)."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from dsv4_kernels import reference, reference_quant, reference_v4, v4_torch
from dsv4_kernels.grouped_moe import grouped_experts

Table = tuple[torch.Tensor, torch.Tensor]


class TorchOps:
    name = "torch"
    # V3 may attend a long extend in the per-head (expanded) form, reading host lengths; the
    # Triton backend keeps every step on its kernels (no host reads: CUDA graphs)
    expanded_prefill = True
    # V4 runs the kernel-shaped path (attention, indexer, pooling, mHC, MoE as kernel calls)
    # rather than the model's batched torch path
    v4_kernel_path = False
    # the native passes grouped_experts may use (the CPU backend's; the reference has none)
    grouped_passes = None

    # ---- the kernel ops (dsv4_kernels.reference / reference_v4 / reference_quant) ----------
    mla_decode = staticmethod(reference.mla_decode)
    mla_extend = staticmethod(reference.mla_extend)
    moe_route = staticmethod(reference.moe_route)
    moe_experts = staticmethod(reference.moe_experts)
    rmsnorm = staticmethod(reference.rmsnorm)
    rope_interleaved_ = staticmethod(reference.rope_interleaved_)
    v4_attention_decode = staticmethod(reference_v4.v4_attention_decode)
    v4_attention_extend = staticmethod(reference_v4.v4_attention_extend)
    v4_indexer_topk = staticmethod(reference_v4.v4_indexer_topk)
    v4_compress_pool = staticmethod(reference_v4.v4_compress_pool)
    v4_hc_pre = staticmethod(reference_v4.v4_hc_pre)
    v4_hc_post = staticmethod(reference_v4.v4_hc_post)
    v4_moe_route = staticmethod(reference_v4.v4_moe_route)
    v4_moe_experts = staticmethod(reference_v4.v4_moe_experts)
    fp8_linear = staticmethod(reference_quant.fp8_linear)
    fp4_linear = staticmethod(reference_quant.fp4_linear)
    fp8_moe_experts = staticmethod(reference_quant.fp8_moe_experts)
    fp4_moe_experts = staticmethod(reference_quant.fp4_moe_experts)

    # ---- V4's stateless torch pieces (dsv4_kernels.v4_torch) ---------------------------------
    rms = staticmethod(v4_torch.rms)
    unweighted_rms = staticmethod(v4_torch.unweighted_rms)
    rope_table = staticmethod(v4_torch.rope_table)
    apply_rope = staticmethod(v4_torch.apply_rope)
    rope_at = staticmethod(v4_torch.rope_at)

    # ---- dense projections ---------------------------------------------------------------
    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w)

    def mlp(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """A dense SwiGLU MLP w2 @ (silu(gate x) * (up x)), w13 [2I, D] (gate rows, then up)."""
        gate, up = F.linear(x, w13).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w2)

    def moe_block(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        shared: Optional[tuple[torch.Tensor, torch.Tensor]],
        experts: Callable,
    ) -> torch.Tensor:
        """V3's MoE after routing: the routed experts (`experts`, quantization-aware) plus the
        shared expert's dense MLP when there is one, added after the routed sum."""
        out = experts(x, w13, w2, weights, ids)
        return out if shared is None else out + self.mlp(x, *shared)

    # ---- V3's absorbed MLA projections -------------------------------------------------
    def mla_absorb_weights(self, w_uk: torch.Tensor, w_uv: torch.Tensor) -> dict[str, torch.Tensor]:
        """Extra layouts of W_UK / W_UV this backend's absorbed projections read (none here)."""
        return {}

    def mla_absorb_q(self, q: torch.Tensor, w_uk: torch.Tensor, extra: dict) -> torch.Tensor:
        """q [T, H, nope + R] -> [T, H, C + R]: the no-position part folded through W_UK [H, nope, C]."""
        nope = w_uk.shape[1]
        q_latent = torch.bmm(q[:, :, :nope].transpose(0, 1), w_uk).transpose(0, 1)
        return torch.cat([q_latent, q[:, :, nope:]], dim=-1)

    def mla_lift_v(self, o: torch.Tensor, dtype: torch.dtype, w_uv: torch.Tensor, extra: dict) -> torch.Tensor:
        """Attention output o [T, H, C] in latent space -> [H, T, v] through W_UV [H, v, C]."""
        return torch.bmm(o.to(dtype).transpose(0, 1), w_uv.transpose(1, 2))

    # ---- V4's torch path ---------------------------------------------------------------------
    def v4_hc_pre_tail(
        self, mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, hc_eps: float, iters: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """mHC after its mixing linear: mixes [T, (2 + hc) * hc] fp32, x [T, hc, D] ->
        (post [T, hc], comb [T, hc, hc], collapsed [T, D] in x's dtype)."""
        hc = x.shape[1]
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
        pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
        post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
        z = comb_w.view(-1, hc, hc) * scale[2] + comb_b.view(hc, hc)
        comb = z.sub_(z.amax(dim=-1, keepdim=True)).exp_()  # softmax over hc: torch's kernel is slow at width 4
        comb.div_(comb.sum(dim=-1, keepdim=True)).add_(hc_eps)
        v4_torch.sinkhorn_(comb, iters, hc_eps)
        collapsed = torch.bmm(pre.unsqueeze(1), x.float()).squeeze(1).to(x.dtype)  # sum_j pre[j] * x[j], in fp32
        return post, comb, collapsed

    def v4_hc_mix(self, x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """mHC after a sublayer on the torch path: stream k = post_k * out + sum_j comb[j, k] x_j."""
        dt = x.dtype
        return torch.baddbmm(post.to(dt).unsqueeze(-1) * out.unsqueeze(-2), comb.to(dt).transpose(-1, -2), x)

    def v4_rms_rope(
        self,
        x: torch.Tensor,
        weight: Optional[torch.Tensor],
        eps: float,
        table: Optional[Table],
        norm: bool = True,
        conj: bool = False,
        inplace: bool = False,
    ) -> torch.Tensor:
        """x [T, n, D]: the rms norm (times weight when given; none when not `norm`), then the
        interleaved rope with a `rope_table` (by -angle when conj); `inplace`: x is the caller's
        to overwrite (the normed copy always is)."""
        if norm:
            x = v4_torch.rms(x, weight, eps) if weight is not None else v4_torch.unweighted_rms(x, eps)
        return x if table is None else v4_torch.apply_rope(x, table, conj=conj, inplace=inplace or norm)

    def v4_pool_windows(
        self,
        win: torch.Tensor,
        prev: Optional[torch.Tensor],
        w_ids: torch.Tensor,
        params,
        rate: int,
        eps: float,
        inv_freq,
    ) -> Optional[torch.Tensor]:
        """V4's compressor pooling of closing windows in one call, or None where this backend
        has none (the model's torch form pools them)."""
        return None

    def v4_moe_block(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        shared: Optional[tuple[torch.Tensor, torch.Tensor]],
        swiglu_limit: float,
    ) -> torch.Tensor:
        """V4's MoE after routing on the torch path: the routed experts grouped by expert (ids
        < 0: another rank's) plus the shared expert (None: another rank adds it)."""

        def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate.clamp(max=swiglu_limit)) * up.clamp(min=-swiglu_limit, max=swiglu_limit)

        out = grouped_experts(x, w13, w2, weights, ids, swiglu, x.dtype, passes=self.grouped_passes)
        return out if shared is None else out + F.linear(swiglu(F.linear(x, shared[0])), shared[1])

    def v4_native_attention(self, width: int, dtype: torch.dtype) -> bool:
        """Whether v4_attend_decode / v4_attend_extend run V4's window attention for this width
        (heads x head_dim) and dtype in one call; where not, the model's batched torch form does."""
        return False

    # ---- what runs ---------------------------------------------------------------------------
    def implementations(self) -> dict[str, str]:
        """Per op group: which implementation this backend runs and why."""
        return {op: "torch: reference" for op in OP_GROUPS}

    def build_failures(self) -> int:
        """Native libraries this backend wanted whose build failed (their ops run the reference)."""
        return 0


def summary(backend: str, implementations: dict[str, str]) -> str:
    """One line for the start-up log: the backend, then each implementation and its ops."""
    by_impl: dict[str, list[str]] = {}
    for op, impl in implementations.items():
        by_impl.setdefault(impl, []).append(op)
    return f"{backend} (" + "; ".join(f"{impl}: {', '.join(ops)}" for impl, ops in by_impl.items()) + ")"


# The op groups a backend reports on (one line each at start-up and in /v1/loads).
OP_GROUPS = (
    "rmsnorm",
    "rope",
    "linear",
    "mlp",
    "mla_absorb",
    "mla_decode",
    "mla_extend",
    "moe_route",
    "moe_experts",
    "v4_attention",
    "v4_rms_rope",
    "v4_compress",
    "v4_indexer",
    "v4_mhc",
    "v4_moe",
    "quant_linear",
)
