"""Build one rank's model: its slice of the weights and the hooks its forward calls."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import torch

from dsv4_engine.parallel.loader import load_shard
from dsv4_engine.parallel.plan import Shard, Slicer, block, dp_plan_for, plan_for
from dsv4_engine.quant.load import NOT_WEIGHTS


class ShardComm:
    """What a sharded model's forward calls (`model.tp`): the sum over ranks, and the mapping
    of the router's global expert choices onto this rank's block of experts."""

    def __init__(self, rank, experts: tuple[int, int], n_experts: int = 0):
        self.rank = rank.shard.rank
        self.size = rank.shard.size
        self._rank = rank
        self.experts = experts  # [lo, hi) of the ids this rank computes (EPLB: physical slots)
        self.n_experts = n_experts  # the checkpoint's routed experts (logical)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self._rank.all_reduce(x)

    def local_experts(self, weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's global choices as this rank's local ids; choices of other ranks' experts
        become -1, which every expert implementation skips (no GEMM rows, nothing added): this
        rank computes only its experts' pairs, and the all-reduce that follows adds the rest.
        Same shapes, no host read (capturable)."""
        lo, hi = self.experts
        mine = (ids >= lo) & (ids < hi)
        return weights * mine, torch.where(mine, ids - lo, torch.full_like(ids, -1))


class DPComm(ShardComm):
    """`model.tp` under --dp-size N: attention and dense layers are whole on every rank (built
    without a sum over ranks: `replicated_attention`); the MoE's sum is as ShardComm's, over
    the tokens of every rank gathered before it (dsv4_engine.parallel.dp_attention)."""

    replicated_attention = True


def build_sharded(
    model_cls, model_type: str, cfg, model_dir: str | Path, ops, dtype: torch.dtype, device: torch.device, rank
):
    dp = getattr(rank, "data_parallel", False)
    plan = dp_plan_for(model_type) if dp else plan_for(model_type)
    refusal = plan.refusal(cfg, rank.shard.size)
    if refusal:
        raise ValueError(refusal)
    weights = load_shard(model_dir, plan.slicer(cfg, rank.shard))
    comm = (DPComm if dp else ShardComm)(rank, block(cfg.n_routed_experts, rank.shard), cfg.n_routed_experts)
    return model_cls(plan.local_config(cfg, rank.shard), weights, ops, dtype, device, tp=comm)


def rank_slicer(model, model_dir: str | Path) -> Optional[Slicer]:
    """The slicer of the rank whose model `model` is (None at --tp-size 1), for weights read
    besides the model's own: the MTP layer's are split as the target's layers are (under
    --dp-size N by the data-parallel plan: attention whole, as the target's)."""
    tp = getattr(model, "tp", None)
    if tp is None:
        return None
    from dsv4_engine.models import entry_for_dir

    entry = entry_for_dir(model_dir)  # the plan splits the checkpoint's full config, not the rank's
    plan = (dp_plan_for if getattr(tp, "replicated_attention", False) else plan_for)(entry.model_type)
    return plan.slicer(entry.config_class().from_dir(model_dir), Shard(tp.rank, tp.size))


def model_tensors(model) -> list[torch.Tensor]:
    """One tensor per distinct storage the model holds (walks its attributes, lists and dicts)."""
    seen: set[int] = set()
    out: list[torch.Tensor] = []

    def walk(obj, depth: int = 0) -> None:
        if depth > 6:
            return
        if isinstance(obj, torch.Tensor):
            key = obj.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                out.append(obj)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, depth + 1)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # a layer (dsv4_engine.layers)
            for f in dataclasses.fields(obj):
                if f.name not in NOT_WEIGHTS:
                    walk(getattr(obj, f.name), depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type) and depth < 5:  # model, layers, sublayers
            for k, v in vars(obj).items():
                if k not in ("cos", "sin", "ops", "tp", "cfg", "backend"):
                    walk(v, depth + 1)

    walk(model)
    return out


def resident_weight_bytes(model) -> int:
    """Bytes of every distinct tensor the model holds."""
    return sum(t.untyped_storage().nbytes() for t in model_tensors(model))
