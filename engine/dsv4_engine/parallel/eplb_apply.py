"""EPLB on a built model: the per-layer hook its MoE calls, the expert weights each rank holds,
and the rebalance at a step boundary (the placement itself is dsv4_engine.parallel.eplb's).

`ExpertPlacer.attach` gives every MoE layer dict of the model a `LayerRoute` under "eplb": the
model's MoE forward passes its router's logical top-k ids through it and gets physical slot ids
back (a replicated expert's tokens spread over its copies by token index), the loads counted on
the way (dsv4_engine.expert_loads). Rank r hosts the physical slots of its contiguous block
(`Placement.rank_block`), so the model's TP hook (`ShardComm.local_experts`) maps them as before.

A rebalance (rank 0, between two steps: `Engine.call`) plans from the loads counted since the last
one, sends the new tables to the other ranks on the step channel (wire.OP_EPLB: every rank agrees
before the next forward), and each rank copies in place the weights of the experts it newly hosts
(read from the checkpoint's files; a copy it already holds is moved within the device), so the
tensors captured CUDA graphs read stay the same.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import safe_open

from dsv4_engine.expert_loads import LOADS_FORMAT, ExpertLoads
from dsv4_engine.parallel import eplb

log = logging.getLogger("dsv4.eplb")


class LayerRoute:
    """One MoE layer's logical -> physical map: `slot_of[e, j]` is copy j of expert e (j <
    copies[e]; later columns repeat copy 0). Within a step, the n-th choice (in token order) of a
    replicated expert goes to copy (n + s) mod copies, s the sum of the step's expert ids: its
    tokens split over the copies to within one in each step, and the odd one out rotates.
    `column[e]` numbers the replicated experts (the others share the last column), so counting
    the n is a cumulative sum over [choices, R + 1], not over every expert. Fixed shapes:
    rewritten in place (captured graphs keep reading the same tensors)."""

    def __init__(self, loads: ExpertLoads, row: int, n_experts: int, redundant: int, device):
        self.loads, self.row = loads, row
        self.slot_of = torch.zeros(n_experts, redundant + 1, dtype=torch.int64, device=device)
        self.copies = torch.ones(n_experts, dtype=torch.int64, device=device)
        self.column = torch.full((n_experts,), redundant, dtype=torch.int64, device=device)
        self.columns = torch.arange(redundant + 1, dtype=torch.int64, device=device)
        self.identity = True

    def set_slots(self, slots: tuple[int, ...]) -> None:
        n = self.slot_of.shape[0]
        table = [[] for _ in range(n)]
        for s, e in enumerate(slots):
            table[e].append(s)
        width = self.slot_of.shape[1]
        rows = [t + [t[0]] * (width - len(t)) for t in table]
        self.slot_of.copy_(torch.tensor(rows, dtype=torch.int64))
        self.copies.copy_(torch.tensor([len(t) for t in table], dtype=torch.int64))
        replicated = [e for e, t in enumerate(table) if len(t) > 1]
        column = [width - 1] * n  # the shared column of the experts with one copy
        for c, e in enumerate(replicated):
            column[e] = c
        self.column.copy_(torch.tensor(column, dtype=torch.int64))
        self.identity = list(slots) == list(range(n))

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.identity:  # one copy each, in expert order: physical = logical
            self.loads.record(self.row, ids)
            return ids
        flat = ids.reshape(-1).long()
        col = self.column[flat]
        # [choices, R + 1] one-hot by comparison: F.one_hot checks its range on the host (a sync
        # that a CUDA graph capture refuses)
        seen = (col.unsqueeze(1) == self.columns).long().cumsum(0)
        # + the sum of the step's ids: which copy takes a step's odd one out varies from step to
        # step (decode steps of a few tokens would otherwise all favour copy 0); the same on
        # every rank, and stateless, so no rank can drift from another
        nth = seen.gather(1, col.unsqueeze(1)).squeeze(1) - 1 + flat.sum()
        slots = self.slot_of[flat, nth % self.copies[flat]].view_as(ids).to(ids.dtype)
        self.loads.record(self.row, ids, slots)
        return slots


def moe_layers(model) -> list[tuple[int, Any]]:
    """(decoder layer index, its MoE block) of the model's main layers: DeepSeek-V3's
    `DeepseekMoE` (`layer.mlp`) or DeepSeek-V4's `V4MoE` (`layer.ffn`, learned and hash-routed
    alike; an MTP block's layer is not among them)."""
    from dsv4_engine.layers.moe import DeepseekMoE, V4MoE

    out = []
    for i, L in enumerate(getattr(model, "layers", [])):
        block = getattr(L, "mlp", None) or getattr(L, "ffn", None)
        if isinstance(block, (DeepseekMoE, V4MoE)):
            out.append((i, block))
    return out


def routing_of(block) -> str:
    """ "hash" for V4's hash-routed layers (experts fixed by the token id), else "learned"."""
    from dsv4_engine.layers.moe import HashRouter

    return "hash" if isinstance(getattr(block, "router", None), HashRouter) else "learned"


def loads_from_table(table: dict) -> dict[int, list[float]]:
    """Layer index -> tokens per logical expert, from `ExpertLoads.table()`'s JSON."""
    if table.get("format") != LOADS_FORMAT:
        raise ValueError(f"not an expert loads table (format {table.get('format')!r}, expected {LOADS_FORMAT!r})")
    return {int(i): [float(n) for n in row["experts"]] for i, row in table["layers"].items()}


def read_loads_file(path: str) -> dict[int, list[float]]:
    try:
        return loads_from_table(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--ep-loads-file {path}: {e}") from None


class CheckpointExperts:
    """Reads single experts' weights from a checkpoint folder (per-expert or fused names)."""

    def __init__(self, model_dir: str | Path):
        from dsv4_engine.parallel.loader import checkpoint_files

        self.dir = Path(model_dir)
        self.where: dict[str, str] = {}
        for name in checkpoint_files(self.dir):
            with safe_open(str(self.dir / name), framework="pt") as f:
                for key in f.keys():
                    if ".experts." in key:
                        self.where[key] = name

    def _get(self, key: str, index: Optional[int] = None) -> torch.Tensor:
        with safe_open(str(self.dir / self.where[key]), framework="pt") as f:
            return f.get_slice(key)[index] if index is not None else f.get_tensor(key)

    def expert(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [2I, H], w2 [H, I]) of logical expert e of decoder layer `layer`: fused
        (transformers' layout, V3 or V4), V3's per-expert names or V4's release names."""
        p = f"model.layers.{layer}.mlp.experts"
        if f"{p}.gate_up_proj" in self.where:
            return self._get(f"{p}.gate_up_proj", e), self._get(f"{p}.down_proj", e)
        v4 = f"layers.{layer}.ffn.experts.{e}."
        if v4 + "w1.weight" in self.where:  # V4 release: w1 gate, w3 up, w2 down
            return torch.cat([self._get(v4 + "w1.weight"), self._get(v4 + "w3.weight")], 0), self._get(v4 + "w2.weight")
        w13 = torch.cat([self._get(f"{p}.{e}.gate_proj.weight"), self._get(f"{p}.{e}.up_proj.weight")], 0)
        return w13, self._get(f"{p}.{e}.down_proj.weight")


class ExpertPlacer:
    """One rank's EPLB state: its layers' routes and which logical expert each local slot holds."""

    def __init__(self, model, model_dir: str | Path, redundant: int, rank: int = 0, ranks: int = 1):
        self.model, self.model_dir = model, model_dir
        self.redundant, self.rank, self.ranks = redundant, rank, ranks
        self.layers = moe_layers(model)
        cfg = model.cfg
        tp = getattr(model, "tp", None)
        # The model was built with the plain split: this rank holds its block of logical experts.
        self.n_experts = cfg.n_routed_experts if tp is None else tp.n_experts
        self.local: dict[int, list[int]] = {}
        if tp is not None:
            lo, hi = tp.experts
        else:
            lo, hi = 0, self.n_experts
        for i, _ in self.layers:
            self.local[i] = list(range(lo, hi))
        n_slots = self.n_experts + redundant
        slot_ranks = [r for r, n in enumerate(eplb.slot_counts(self.n_experts, redundant, ranks)) for _ in range(n)]
        device = model.device
        routing = [routing_of(L) for _, L in self.layers]
        self.loads = ExpertLoads([i for i, _ in self.layers], self.n_experts, n_slots, slot_ranks, device, routing)
        self.routes = {}
        for row, (i, L) in enumerate(self.layers):
            self.routes[i] = L.eplb = LayerRoute(self.loads, row, self.n_experts, redundant, device)
        self.placement: Optional[eplb.Placement] = None
        self._base: Optional[list[list[int]]] = None  # logical counts at the last rebalance
        self.planned_from: dict[int, list[float]] = {}  # the loads the last placement was planned from
        self._experts: Optional[CheckpointExperts] = None

    def apply(self, placement: eplb.Placement) -> None:
        """Host this rank's slots of `placement`: weights and routes (the first call sizes the
        stacked tensors for the block's slots; later ones copy in place)."""
        lo, hi = placement.rank_block(self.rank)
        first = self.placement is None
        for i, L in self.layers:
            slots = placement.layers[i]
            want = list(slots[lo:hi])
            have = self.local[i]
            if want != have or first:
                w13, w2 = L.w13, L.w2
                rows13, rows2 = [], []
                for e in want:
                    if e in have:
                        j = have.index(e)
                        rows13.append(w13[j].clone())
                        rows2.append(w2[j].clone())
                    else:
                        a, b = self._reader().expert(i, e)
                        rows13.append(a.to(device=w13.device, dtype=w13.dtype))
                        rows2.append(b.to(device=w2.device, dtype=w2.dtype))
                new13, new2 = torch.stack(rows13), torch.stack(rows2)
                if new13.shape == w13.shape:
                    w13.copy_(new13)
                    w2.copy_(new2)
                else:
                    L.w13, L.w2 = new13.contiguous(), new2.contiguous()
                self.local[i] = want
            self.routes[i].set_slots(slots)
        tp = getattr(self.model, "tp", None)
        if tp is not None:
            tp.experts = (lo, hi)
        self.placement = placement

    def summary(self) -> dict:
        """/v1/loads `expert_loads`: the counters' summary and how the experts are placed."""
        return {
            "redundant_experts": self.redundant,
            "ranks": self.ranks,
            "placed": self.placement is not None,
            "layers": self.loads.summary(),
        }

    def table(self) -> dict:
        """GET /admin/expert_loads: every counter, and the placement (physical slot -> expert)."""
        return {**self.loads.table(), "placement": self.placement.to_json() if self.placement else None}

    def _reader(self) -> CheckpointExperts:
        if self._experts is None:
            self._experts = CheckpointExperts(self.model_dir)
        return self._experts

    def plan(self, loads: Optional[dict[int, list[float]]] = None) -> eplb.Placement:
        """A placement from `loads`, else from the loads counted since the last rebalance (all of
        them when none came since)."""
        if loads is None:
            now = self.loads.logical.cpu().tolist()
            base = self._base or [[0] * self.n_experts for _ in now]
            delta = [[a - b for a, b in zip(r, s)] for r, s in zip(now, base)]
            if not any(any(r) for r in delta):
                delta = now
            loads = {i: [float(n) for n in delta[row]] for row, (i, _) in enumerate(self.layers)}
            self._base = now
        missing = [i for i, _ in self.layers if i not in loads]
        if missing:
            raise ValueError(f"the loads name no MoE layer {missing[0]} (layers {sorted(loads)})")
        wrong = [i for i, _ in self.layers if len(loads[i]) != self.n_experts]
        if wrong:
            raise ValueError(
                f"the loads of layer {wrong[0]} name {len(loads[wrong[0]])} experts; this model has {self.n_experts}"
            )
        self.planned_from = {i: loads[i] for i, _ in self.layers}
        return eplb.plan(self.planned_from, self.redundant, self.ranks)


# ---- the step channel ---------------------------------------------------------------------------


def placement_message(placement: eplb.Placement) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of a rebalance: [n_experts, redundant, ranks, n_layers, (layer, slots...)...]."""
    from dsv4_engine.parallel import wire

    body = [placement.n_experts, placement.redundant, placement.ranks, len(placement.layers)]
    for i, slots in sorted(placement.layers.items()):
        body += [i, *slots]
    payload = torch.tensor(body, dtype=torch.int64)
    header = torch.zeros(wire.HEADER_LEN, dtype=torch.int64)
    header[wire.OP], header[wire.PAYLOAD] = wire.OP_EPLB, payload.numel()
    return header, payload


def unpack_placement(payload: torch.Tensor) -> eplb.Placement:
    v = payload.tolist()
    n, r, ranks, count = v[:4]
    width = n + r
    layers, at = {}, 4
    for _ in range(count):
        layers[v[at]] = tuple(v[at + 1 : at + 1 + width])
        at += 1 + width
    return eplb.Placement(n, r, ranks, layers)


def rebalance(placer: ExpertPlacer, group=None, loads: Optional[dict[int, list[float]]] = None) -> dict:
    """Rank 0, between steps: plan, tell the other ranks, apply here. Returns the plan's report."""
    placement = placer.plan(loads)
    if group is not None:
        import torch.distributed as dist

        with group.step("rebalancing the experts on every rank"):
            header, payload = placement_message(placement)
            dist.broadcast(header, 0, group=group.rank.control)
            dist.broadcast(payload, 0, group=group.rank.control)
            placer.apply(placement)
    else:
        placer.apply(placement)
    out = eplb.report(placer.planned_from, placement)
    log.info("experts rebalanced: worst rank max/mean %s", out.get("worst"))
    return {"placement": placement.to_json(), "report": out}


def attach_eplb(model, model_dir, redundant: int = 0, loads_file: Optional[str] = None) -> Optional[ExpertPlacer]:
    """Count the expert loads of a V3 or V4 model's MoE layers (None for a model without any),
    and with `redundant` > 0 place the experts: from the loads in `loads_file`, else evenly
    (every expert the same load: the first R experts get the copies) until a rebalance."""
    if not moe_layers(model):
        if redundant:  # the engine core refuses it earlier (eplb.ep_checkpoint_refusal), in one line
            raise ValueError("--ep-redundant-experts: this model has no routed-expert MoE layers to place")
        return None
    tp = getattr(model, "tp", None)
    placer = ExpertPlacer(model, model_dir, redundant, tp.rank if tp else 0, tp.size if tp else 1)
    if redundant or loads_file:
        loads = read_loads_file(loads_file) if loads_file else None
        if loads is None:
            loads = {i: [1.0] * placer.n_experts for i, _ in placer.layers}
        placer.apply(placer.plan(loads))
    return placer
