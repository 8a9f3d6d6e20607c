"""The MoE block: a router that picks each token's experts and their weights, the routed experts
through the kernel API, and the shared experts.

Routers: DeepSeek-V3's (`GroupLimitedRouter`: sigmoid scores, bias-corrected top-k within the
best groups), DeepSeek-V4's (`ScoreRouter`: sqrt-softplus scores, bias-corrected top-k) and V4's
hash routing of its first layers (`HashRouter`: the experts a table assigns to the token id).

Tensor / expert parallelism (dsv4_engine.parallel): each rank holds a block of the routed experts
under local ids; the router stays replicated and speaks global ids, `tp.local_experts` maps them
(another rank's choice becomes -1, which every expert implementation skips), and the ranks' partial
sums are added by one all-reduce. V3's shared experts are split like a dense MLP (every rank adds
its part); V4's are replicated and join the sum on rank 0 only (under --dp-size N each rank adds
them to its own rows: `V4MoE.shared_expert`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from dsv4_engine.layers.linear import Weight
from dsv4_engine.quant import is_quantized

Routing = tuple[torch.Tensor, torch.Tensor]  # (weights [T, k] fp32, expert ids [T, k])


def stack_experts(take, names, prefix: str, n: int, gate: str, up: str, down: str) -> tuple[Weight, Weight]:
    """Experts `{prefix}.{e}.{gate|up|down}.weight` stacked into w13 [E, 2I, D] and w2 [E, D, I];
    `{prefix}.gate_up_proj` / `.down_proj`, as some transformers versions write them, as they are."""
    if prefix + ".gate_up_proj" in names:
        return take(prefix + ".gate_up_proj"), take(prefix + ".down_proj")
    w13 = torch.stack(
        [torch.cat([take(f"{prefix}.{e}.{gate}.weight"), take(f"{prefix}.{e}.{up}.weight")], 0) for e in range(n)]
    )
    w2 = torch.stack([take(f"{prefix}.{e}.{down}.weight") for e in range(n)])
    return w13.contiguous(), w2.contiguous()


# ---- routers ---------------------------------------------------------------------------------


@dataclass
class GroupLimitedRouter:
    """DeepSeek-V3's `noaux_tc` routing (`ops.moe_route`)."""

    gate: torch.Tensor  # [E, D] fp32
    bias: torch.Tensor  # [E] fp32: the score correction, for choosing only
    n_group: int
    topk_group: int
    top_k: int
    norm_topk_prob: bool
    scaling: float
    ops: Any

    def __call__(self, x: torch.Tensor, input_ids: Optional[torch.Tensor] = None) -> Routing:
        logits = self.ops.linear(x.float(), self.gate)
        return self.ops.moe_route(
            logits, self.bias, self.n_group, self.topk_group, self.top_k, self.norm_topk_prob, self.scaling
        )


def _v4_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    return F.softplus(logits).sqrt() if scoring_func == "sqrtsoftplus" else torch.sigmoid(logits)


def _v4_weights(scores: torch.Tensor, ids: torch.Tensor, scaling: float) -> Routing:
    wts = scores.gather(1, ids)
    return wts / (wts.sum(dim=-1, keepdim=True) + 1e-20) * scaling, ids


@dataclass
class ScoreRouter:
    """DeepSeek-V4's routing: sqrt-softplus (or sigmoid) scores, the bias-corrected top-k, the
    chosen scores normalised and scaled. `kops`: the backend's kernel path (`v4_moe_route`)."""

    gate: Weight
    bias: torch.Tensor
    top_k: int
    scaling: float
    scoring_func: str
    kops: Any = None

    def __call__(self, x: torch.Tensor, input_ids: torch.Tensor) -> Routing:
        logits = F.linear(x, self.gate)
        if self.kops is not None:
            return self.kops.v4_moe_route(
                logits, self.bias, None, input_ids, self.top_k, self.scaling, self.scoring_func
            )
        scores = _v4_scores(logits, self.scoring_func)
        ids = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        return _v4_weights(scores, ids, self.scaling)


@dataclass
class HashRouter:
    """DeepSeek-V4's hash routing (its first layers): the experts are the token id's row of a
    fixed table; only their weights come from the scores."""

    gate: Weight
    tid2eid: torch.Tensor  # [vocab, top_k] long
    top_k: int
    scaling: float
    scoring_func: str
    kops: Any = None

    def __call__(self, x: torch.Tensor, input_ids: torch.Tensor) -> Routing:
        logits = F.linear(x, self.gate)
        if self.kops is not None:
            return self.kops.v4_moe_route(
                logits, None, self.tid2eid, input_ids, self.top_k, self.scaling, self.scoring_func
            )
        return _v4_weights(_v4_scores(logits, self.scoring_func), self.tid2eid[input_ids], self.scaling)


# ---- the blocks ------------------------------------------------------------------------------


@dataclass
class DeepseekMoE:
    """DeepSeek-V3's MoE: routed experts (`experts`: the backend's, or the block-scaled kernels
    for quantized weights) plus the shared experts' dense MLP, in one `ops.moe_block`."""

    router: GroupLimitedRouter
    w13: Weight  # [E_local, 2I, D]
    w2: Weight  # [E_local, D, I]
    shared: Optional[tuple[Weight, Weight]]  # (w13, w2) of the shared experts, this rank's part
    experts: Callable
    ops: Any
    tp: Any = None
    # EPLB hook (dsv4_engine.parallel.eplb_apply.LayerRoute): counts this layer's expert loads and
    # maps logical expert ids to physical slots (a replicated expert's copies)
    eplb: Optional[Callable] = None

    @classmethod
    def build(cls, take, names, prefix: str, cfg, ops, tp, experts: Callable) -> "DeepseekMoE":
        """From DeepSeek-V3's `{prefix}gate`, `{prefix}experts`, `{prefix}shared_experts` tensors."""
        f32 = torch.float32
        router = GroupLimitedRouter(
            take(prefix + "gate.weight", f32),
            take(prefix + "gate.e_score_correction_bias", f32),
            cfg.n_group,
            cfg.topk_group,
            cfg.num_experts_per_tok,
            cfg.norm_topk_prob,
            cfg.routed_scaling_factor,
            ops,
        )
        w13, w2 = stack_experts(
            take, names, prefix + "experts", cfg.n_routed_experts, "gate_proj", "up_proj", "down_proj"
        )
        shared = None
        if cfg.n_shared_experts:
            s = prefix + "shared_experts."
            s13 = torch.cat([take(s + "gate_proj.weight"), take(s + "up_proj.weight")], 0)
            shared = (s13, take(s + "down_proj.weight"))
        return cls(router, w13, w2, shared, experts, ops, tp)

    def __call__(self, x: torch.Tensor, input_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        weights, ids = self.router(x)
        if self.eplb is not None:
            ids = self.eplb(ids)
        if self.tp is not None:
            weights, ids = self.tp.local_experts(weights, ids)
        out = self.ops.moe_block(x, self.w13, self.w2, weights, ids, self.shared, self.experts)
        return out if self.tp is None else self.tp.all_reduce(out)


@dataclass
class V4MoE:
    """DeepSeek-V4's MoE: routed experts with the clamped SwiGLU, plus the shared expert."""

    router: ScoreRouter | HashRouter
    w13: Weight
    w2: Weight
    shared: tuple[Weight, Weight]  # replicated; joins the sum on rank 0 only
    swiglu_limit: float
    experts: Callable  # the block-scaled kernels for quantized experts
    ops: Any
    kops: Any = None  # the backend's kernel path (v4_kernel_path), or None for the torch path
    tp: Any = None
    eplb: Optional[Callable] = None  # EPLB hook, as DeepseekMoE's (learned and hash-routed layers alike)

    @classmethod
    def build(cls, take, prefix: str, cfg, hashed: bool, ops, kops, tp, experts: Callable) -> "V4MoE":
        """From DeepSeek-V4's release names under `prefix` (`gate`, `experts.{e}.w1/w2/w3`,
        `shared_experts`)."""
        route = (cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.scoring_func, kops)
        gate = take(prefix + "gate.weight")
        if hashed:
            router = HashRouter(gate, take(prefix + "gate.tid2eid", None).long(), *route)
        else:
            router = ScoreRouter(gate, take(prefix + "gate.bias", torch.float32), *route)
        w13, w2 = stack_experts(take, (), prefix + "experts", cfg.n_routed_experts, "w1", "w3", "w2")
        s = prefix + "shared_experts."
        shared = (torch.cat([take(s + "w1.weight"), take(s + "w3.weight")], 0), take(s + "w2.weight"))
        return cls(router, w13, w2, shared, cfg.swiglu_limit, experts, ops, kops, tp)

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        lim = self.swiglu_limit
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate.clamp(max=lim)) * up.clamp(min=-lim, max=lim)

    def shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert alone: under --dp-size N each rank adds it to its own rows (it is
        whole on every rank), not rank 0 to every rank's."""
        return F.linear(self._swiglu(F.linear(x, self.shared[0])), self.shared[1])

    def __call__(self, x: torch.Tensor, input_ids: torch.Tensor, with_shared: bool = True) -> torch.Tensor:
        wts, ids = self.router(x, input_ids)
        if self.eplb is not None:
            ids = self.eplb(ids)
        if self.tp is not None:  # one rank of --tp-size N: only its experts' share of the sum
            wts, ids = self.tp.local_experts(wts, ids)
        shared = self.shared if with_shared and (self.tp is None or self.tp.rank == 0) else None
        if is_quantized(self.w13) or self.kops is not None:
            if is_quantized(self.w13):  # fp8/fp4 experts: the grouped block-scaled kernels, no host reads
                out = self.experts(x, self.w13, self.w2, wts, ids)
            else:
                out = self.kops.v4_moe_experts(x, self.w13, self.w2, wts, ids, self.swiglu_limit)
            if shared is not None:
                out = out + self.shared_expert(x)
        else:  # pairs grouped by expert (ids < 0: another rank's), or the backend's one call
            out = self.ops.v4_moe_block(x, self.w13, self.w2, wts, ids, shared, self.swiglu_limit)
        return out if self.tp is None else self.tp.all_reduce(out)
