"""Sharding plans: which slice of which checkpoint tensor each rank keeps. Pure functions of
(config, tensor name, shape, rank, world size); no I/O, so they are tested on their own.

DeepSeek-V3 over N ranks:
- attention: heads split (q_b / q_proj and kv_b rows, o_proj columns by head block); the MLA
  latent is per token and shared by every head, so each rank computes and caches the full
  latent itself (kv_a replicated): KV memory is replicated, weights are not;
- dense MLP and shared experts: tensor parallel (gate/up rows, down columns);
- routed experts: expert parallel, rank r holds a contiguous block of 1/N of them, renamed to
  local ids 0..E_r-1 (the router stays replicated and speaks global ids);
- embeddings, LM head, norms, router: replicated (the vocab is small next to the experts, and a
  replicated head needs no gather before sampling).
Every partial result (o_proj, MLP, experts) is summed by one all-reduce per sub-layer.

DeepSeek-V4: attention split by query heads and output groups (wq_b rows, sinks; wo_a rows, wo_b
columns; one all-reduce after the output projection) where the groups divide evenly and the
quantization blocks allow (`v4_splits_attention`); its single KV head, compressors and indexer
replicated. Routed experts split as above; the shared expert runs on rank 0 only and joins the
routed sum. See docs/tensor-parallel.md for data-parallel attention (`--dp-size N`, below), where
attention, norms, compressors, indexer and mHC stay whole on each rank and only the MoE splits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Callable, Optional

# (local name, one slice per leading dim) or None: the rank does not keep the tensor.
Slice = Optional[tuple[str, tuple[slice, ...]]]
Slicer = Callable[[str, tuple[int, ...]], Slice]


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int

    def __post_init__(self):
        if not (0 <= self.rank < self.size):
            raise ValueError(f"rank {self.rank} is not in a world of {self.size}")


def block(total: int, shard: Shard) -> tuple[int, int]:
    """[lo, hi) of rank's contiguous block when `total` items are split as evenly as possible."""
    base, rem = divmod(total, shard.size)
    lo = shard.rank * base + min(shard.rank, rem)
    return lo, lo + base + (1 if shard.rank < rem else 0)


def even(total: int, shard: Shard, what: str) -> tuple[int, int]:
    if total % shard.size:
        raise ValueError(f"--tp-size {shard.size} does not divide {what} ({total})")
    n = total // shard.size
    return shard.rank * n, (shard.rank + 1) * n


_EXPERT = re.compile(r"^(?P<pre>.*\.experts)\.(?P<e>\d+)\.(?P<rest>.+)$")
_FUSED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)(_scale_inv)?$")  # and their stacked scales


def expert_slice(name: str, shape: tuple[int, ...], lo: int, hi: int) -> Slice | bool:
    """Routed experts: keep block [lo, hi) under local ids; False when `name` is no expert."""
    m = _EXPERT.match(name)
    if m:
        e = int(m["e"])
        if not (lo <= e < hi):
            return None
        return f"{m['pre']}.{e - lo}.{m['rest']}", ()
    if _FUSED_EXPERTS.search(name):  # [E, ...] stacked by some transformers versions
        return name, (slice(lo, hi),)
    return False


# ---- DeepSeek-V3 ------------------------------------------------------------------------------


def _layer_kinds(cfg) -> tuple[bool, bool]:
    """(has dense MLP layers, has MoE layers): dense layers come from first_k_dense_replace, from
    moe_layer_freq > 1, or from a model without routed experts."""
    moe = [cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)]
    return not all(moe), any(moe)


def v3_refusal(cfg, size: int) -> Optional[str]:
    """Why this V3 config cannot run on `size` ranks (one line), or None."""
    has_dense, has_moe = _layer_kinds(cfg)
    if cfg.num_attention_heads % size:
        return f"--tp-size {size} does not divide num_attention_heads ({cfg.num_attention_heads})"
    if cfg.intermediate_size % size and has_dense:
        return f"--tp-size {size} does not divide intermediate_size ({cfg.intermediate_size})"
    shared = cfg.moe_intermediate_size * (cfg.n_shared_experts or 0) if has_moe else 0
    if shared % size:
        return f"--tp-size {size} does not divide the shared experts' width ({shared})"
    if cfg.n_routed_experts and cfg.n_routed_experts < size:
        return f"--tp-size {size} is more than the routed experts ({cfg.n_routed_experts})"
    qb = quant_block(cfg)
    if qb:
        h = cfg.num_attention_heads // size
        widths = {
            "q_b rows": h * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim),
            "kv_b rows": h * (cfg.qk_nope_head_dim + cfg.v_head_dim),
            "o_proj columns": h * cfg.v_head_dim,
            "dense MLP width": cfg.intermediate_size // size if has_dense else 0,
            "shared experts' width": shared // size,
        }
        for what, w in widths.items():
            if w % qb[0] or w % qb[1]:
                return f"--tp-size {size} leaves {w} {what} a rank, off the {qb[0]}x{qb[1]} quantization blocks"
    return None


def v3_local_config(cfg, shard: Shard):
    """The config one rank's model is built from: its heads, its MLP width, its experts."""
    lo, hi = block(cfg.n_routed_experts, shard)
    return replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // shard.size,
        intermediate_size=cfg.intermediate_size // shard.size,
        n_routed_experts=hi - lo,
    )


def quant_block(cfg) -> Optional[tuple[int, int]]:
    """(rows, cols) of one fp8 scale block when the checkpoint is block-quantized, else None."""
    qc = (getattr(cfg, "extra", None) or {}).get("quantization_config") or {}
    size = qc.get("weight_block_size")
    return (int(size[0]), int(size[1])) if size else None


def v3_slicer(cfg, shard: Shard) -> Slicer:
    H = cfg.num_attention_heads
    qk, kvb = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim
    h0, h1 = even(H, shard, "num_attention_heads")
    e0, e1 = block(cfg.n_routed_experts, shard)
    dense = cfg.intermediate_size
    shared = cfg.moe_intermediate_size * cfg.n_shared_experts
    qblock = quant_block(cfg)

    def split_of(base: str) -> Optional[tuple[int, int, int]]:
        """(dim, lo, hi) of this rank's part of weight `base` (a name ending in .weight), or None."""
        if base.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")):
            return 0, h0 * qk, h1 * qk
        if base.endswith("self_attn.kv_b_proj.weight"):
            return 0, h0 * kvb, h1 * kvb
        if base.endswith("self_attn.o_proj.weight"):
            return 1, h0 * cfg.v_head_dim, h1 * cfg.v_head_dim
        if base.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            return (0, *even(dense, shard, "intermediate_size"))
        if base.endswith(("shared_experts.gate_proj.weight", "shared_experts.up_proj.weight")):
            return (0, *even(shared, shard, "the shared experts' width"))
        if base.endswith("mlp.down_proj.weight"):
            return (1, *even(dense, shard, "intermediate_size"))
        if base.endswith("shared_experts.down_proj.weight"):
            return (1, *even(shared, shard, "the shared experts' width"))
        return None

    def index(dim: int, lo: int, hi: int) -> tuple[slice, ...]:
        return (slice(lo, hi),) if dim == 0 else (slice(None), slice(lo, hi))

    def slicer(name: str, shape: tuple[int, ...]) -> Slice:
        ex = expert_slice(name, shape, e0, e1)
        if ex is not False:
            return ex  # type: ignore[return-value]
        # fp8 block scales follow their weight's split (both spellings pair_quantized reads)
        weight = (
            name.removesuffix("_scale_inv")
            if name.endswith(".weight_scale_inv")
            else name.removesuffix(".scale") + ".weight"
            if name.endswith(".scale")
            else None
        )
        if weight is not None:
            part = split_of(weight)
            if part is None:
                return name, ()
            dim, lo, hi = part
            b = qblock[dim] if qblock else 1
            if lo % b or hi % b:
                raise ValueError(f"--tp-size {shard.size} splits {name} off its {b}-wide quantization blocks")
            return name, index(dim, lo // b, hi // b)
        part = split_of(name)
        return (name, ()) if part is None else (name, index(*part))

    return slicer


# ---- DeepSeek-V3 with data-parallel attention (--dp-size N) -------------------------------------

_DENSE_MLP = re.compile(r"\.mlp\.(gate|up|down)_proj\.(weight|weight_scale_inv|scale)$")


def dp_v3_refusal(cfg, size: int) -> Optional[str]:
    """Attention and dense layers are whole on every rank: only the MoE's widths must split."""
    has_moe = _layer_kinds(cfg)[1]
    shared = cfg.moe_intermediate_size * (cfg.n_shared_experts or 0) if has_moe else 0
    if shared % size:
        return f"--dp-size {size} does not divide the shared experts' width ({shared})"
    if cfg.n_routed_experts and cfg.n_routed_experts < size:
        return f"--dp-size {size} is more than the routed experts ({cfg.n_routed_experts})"
    qb = quant_block(cfg)
    if qb and (shared // size) % qb[0]:
        return f"--dp-size {size} leaves {shared // size} shared experts' width a rank, off the {qb[0]}-wide blocks"
    return None


def dp_v3_local_config(cfg, shard: Shard):
    """Every head and the whole dense MLP (each rank attends over its own requests); its experts."""
    lo, hi = block(cfg.n_routed_experts, shard)
    return replace(cfg, n_routed_experts=hi - lo)


def dp_v3_slicer(cfg, shard: Shard) -> Slicer:
    """As V3's TP slicer for the MoE (routed experts in blocks, shared experts split), attention
    and dense MLPs replicated."""
    whole_heads = replace(cfg, num_attention_heads=shard.size)  # the heads are not split: any count
    moe = v3_slicer(whole_heads, shard)

    def slicer(name: str, shape: tuple[int, ...]) -> Slice:
        if ".self_attn." in name or _DENSE_MLP.search(name):
            return name, ()
        return moe(name, shape)

    return slicer


# ---- DeepSeek-V4 ------------------------------------------------------------------------------


def v4_refusal(cfg, size: int) -> Optional[str]:
    if cfg.n_routed_experts < size:
        return f"--tp-size {size} is more than the routed experts ({cfg.n_routed_experts})"
    return None


def v4_splits_attention(cfg, size: int) -> bool:
    """Whether V4's attention is split by heads over `size` ranks: when the output projection's
    groups divide evenly (a group's heads stay on one rank) and every split width stays on the
    checkpoint's quantization blocks; else every rank runs all heads, as before the split."""
    if size == 1 or cfg.o_groups % size:
        return False
    qb = quant_block(cfg)
    widths = ((cfg.num_attention_heads // size) * cfg.head_dim, (cfg.o_groups // size) * cfg.o_lora_rank)
    return not qb or all(w % qb[0] == 0 and w % qb[1] == 0 for w in widths)


def v4_local_config(cfg, shard: Shard):
    lo, hi = block(cfg.n_routed_experts, shard)
    if not v4_splits_attention(cfg, shard.size):
        return replace(cfg, n_routed_experts=hi - lo)
    return replace(
        cfg,
        n_routed_experts=hi - lo,
        num_attention_heads=cfg.num_attention_heads // shard.size,
        o_groups=cfg.o_groups // shard.size,
        attention_tp_size=shard.size,
    )


def v4_slicer(cfg, shard: Shard) -> Slicer:
    """Routed experts by block; with the attention split (`v4_splits_attention`), this rank's
    query heads (wq_b rows, sinks) and output groups (wo_a rows, wo_b columns), with their
    block scales. Names in any layout (matched on their release names)."""
    from dsv4_engine.models.deepseek_v4_weights import release_name  # the model's naming, read lazily

    e0, e1 = block(cfg.n_routed_experts, shard)
    split = v4_splits_attention(cfg, shard.size)
    heads = even(cfg.num_attention_heads, shard, "num_attention_heads") if split else (0, 0)
    groups = even(cfg.o_groups, shard, "o_groups") if split else (0, 0)
    hd, ol = cfg.head_dim, cfg.o_lora_rank
    qb = quant_block(cfg) or (1, 1)

    def part(release: str) -> Optional[tuple[int, int, int, bool]]:
        """(dim, lo, hi, is a block scale) of this rank's part of a release-named tensor, or None."""
        base, scale = (release[: -len(".scale")] + ".weight", True) if release.endswith(".scale") else (release, False)
        if not split or ".attn." not in base or ".indexer." in base or ".compressor." in base:
            return None
        if base.endswith(".attn.wq_b.weight"):
            return 0, heads[0] * hd, heads[1] * hd, scale
        if base.endswith(".attn.wo_a.weight"):
            return 0, groups[0] * ol, groups[1] * ol, scale
        if base.endswith(".attn.wo_b.weight"):
            return 1, groups[0] * ol, groups[1] * ol, scale
        if base.endswith(".attn.attn_sink"):
            return 0, heads[0], heads[1], False
        return None

    def slicer(name: str, shape: tuple[int, ...]) -> Slice:
        ex = expert_slice(name, shape, e0, e1)
        if ex is not False:
            return ex  # type: ignore[return-value]
        got = part(release_name(name))
        if got is None:
            return name, ()
        dim, lo, hi, scale = got
        if scale:
            lo, hi = lo // qb[dim], hi // qb[dim]
        return name, (slice(lo, hi),) if dim == 0 else (slice(None), slice(lo, hi))

    return slicer


# ---- DeepSeek-V4 with data-parallel attention (--dp-size N) -------------------------------------


def dp_v4_refusal(cfg, size: int) -> Optional[str]:
    """Attention, compressors, indexer and mHC are whole on every rank: only the routed experts split."""
    if cfg.n_routed_experts < size:
        return f"--dp-size {size} is more than the routed experts ({cfg.n_routed_experts})"
    return None


def dp_v4_local_config(cfg, shard: Shard):
    """Every query head and output group (attention_tp_size stays 1: no sum over ranks after the
    output projection); its block of the routed experts."""
    lo, hi = block(cfg.n_routed_experts, shard)
    return replace(cfg, n_routed_experts=hi - lo)


def dp_v4_slicer(cfg, shard: Shard) -> Slicer:
    """Routed experts by block (hash-routed layers too: their table speaks global ids, as the
    router's scores do); everything else, the shared expert included, whole."""
    e0, e1 = block(cfg.n_routed_experts, shard)

    def slicer(name: str, shape: tuple[int, ...]) -> Slice:
        ex = expert_slice(name, shape, e0, e1)
        return (name, ()) if ex is False else ex  # type: ignore[return-value]

    return slicer


@dataclass(frozen=True)
class Plan:
    refusal: Callable
    local_config: Callable
    slicer: Callable


PLANS = {
    "deepseek_v3": Plan(v3_refusal, v3_local_config, v3_slicer),
    "deepseek_v2": Plan(v3_refusal, v3_local_config, v3_slicer),
    "deepseek_v4": Plan(v4_refusal, v4_local_config, v4_slicer),
}


# --dp-size N: data-parallel attention.
DP_PLANS = {
    "deepseek_v3": Plan(dp_v3_refusal, dp_v3_local_config, dp_v3_slicer),
    "deepseek_v2": Plan(dp_v3_refusal, dp_v3_local_config, dp_v3_slicer),
    "deepseek_v4": Plan(dp_v4_refusal, dp_v4_local_config, dp_v4_slicer),
}


def dp_plan_for(model_type: str) -> Plan:
    if model_type not in DP_PLANS:
        raise ValueError(f"--dp-size > 1 is not supported for model_type {model_type!r}")
    return DP_PLANS[model_type]


def plan_for(model_type: str) -> Plan:
    if model_type not in PLANS:
        raise ValueError(f"--tp-size > 1 is not supported for model_type {model_type!r}")
    return PLANS[model_type]


def tp_refusal(model_type: str, cfg, size: int) -> Optional[str]:
    """Why a checkpoint cannot be served over `size` ranks, in one line, or None."""
    if size < 1:
        return f"--tp-size must be at least 1, not {size}"
    if size == 1:
        return None
    try:
        return plan_for(model_type).refusal(cfg, size)
    except ValueError as e:
        return str(e)
