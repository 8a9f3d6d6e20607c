"""Expert-parallel load balancing (EPLB): where the copies of each routed expert live.

Pure, torch-free functions of recorded loads (tokens routed to each logical expert of a layer):
- `replicas`: R extra copies go to the hottest experts, one at a time, each to the expert whose
  load per copy is the highest at that moment (ties: the lower expert id);
- `pack`: the physical experts (a copy carries its expert's load / copies) are placed on the ranks
  by longest-processing-time bin packing: heaviest first, each onto the least-loaded rank that has
  a free slot and does not hold that expert yet (ties: the lower rank). Every rank has the slots of
  its contiguous block of the E + R physical slots (`slot_counts`), so with R <= ranks a rank holds
  its E / N share plus at most one redundant expert;
- `place_layer` / `plan`: one layer's / every MoE layer's physical slot -> logical expert table,
  the slots in rank order (rank r owns the r-th block), which is what the model's hook and the
  weight loader read (`dsv4_engine.parallel.eplb_apply`).
Within a step, the n-th choice (in token order) of a replicated expert goes to its copy (n + s)
mod copies, s the sum of the step's expert ids: deterministic, within one token of even, and every copy holds the same weights, so the
output does not depend on the placement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from dsv4_engine.parallel.plan import Shard, block


def eplb_refusal(n_experts: int, redundant: int, ranks: int) -> Optional[str]:
    """Why `--ep-redundant-experts redundant` cannot be placed over `ranks`, in one line, or None."""
    if redundant < 0:
        return f"--ep-redundant-experts must be >= 0, not {redundant}"
    if redundant and n_experts < 1:
        return "--ep-redundant-experts needs a model with routed experts"
    if redundant > ranks:
        return (
            f"--ep-redundant-experts {redundant} is more than one redundant expert per rank "
            f"(--tp-size {ranks} allows at most {ranks})"
        )
    return None


def slot_counts(n_experts: int, redundant: int, ranks: int) -> list[int]:
    """Physical slots of each rank: the contiguous blocks of E + R slots over the ranks."""
    return [hi - lo for lo, hi in (block(n_experts + redundant, Shard(r, ranks)) for r in range(ranks))]


def replicas(loads: Sequence[float], redundant: int) -> list[int]:
    """Copies of each expert (>= 1, summing to len(loads) + redundant): each extra copy to the
    expert with the highest load per copy so far."""
    copies = [1] * len(loads)
    for _ in range(redundant):
        best = max(range(len(loads)), key=lambda e: (loads[e] / copies[e], -e))
        copies[best] += 1
    return copies


def pack(loads: Sequence[float], copies: Sequence[int], caps: Sequence[int]) -> list[list[int]]:
    """Logical experts on each rank (sorted), by longest-processing-time bin packing of the
    physical experts under each rank's slot count `caps`."""
    if sum(copies) != sum(caps):
        raise ValueError(f"{sum(copies)} physical experts do not fill {sum(caps)} slots")
    items = sorted(
        ((loads[e] / copies[e], e) for e in range(len(loads)) for _ in range(copies[e])), key=lambda x: (-x[0], x[1])
    )
    held: list[list[int]] = [[] for _ in caps]
    total = [0.0] * len(caps)
    for load, e in items:
        room = [r for r in range(len(caps)) if len(held[r]) < caps[r]]
        fresh = [r for r in room if e not in held[r]] or room  # a second copy on one rank balances nothing
        r = min(fresh, key=lambda r: (total[r], r))
        held[r].append(e)
        total[r] += load
    return [sorted(h) for h in held]


def place_layer(loads: Sequence[float], redundant: int, ranks: int) -> tuple[int, ...]:
    """One layer's physical slot -> logical expert, rank blocks in order."""
    caps = slot_counts(len(loads), redundant, ranks)
    return tuple(e for rank in pack(loads, replicas(loads, redundant), caps) for e in rank)


def block_layer(n_experts: int, ranks: int) -> tuple[int, ...]:
    """The placement without EPLB: expert e on the rank of its contiguous block, one copy each."""
    return tuple(range(n_experts))


def rank_loads(loads: Sequence[float], slots: Sequence[int], ranks: int) -> list[float]:
    """Each rank's load when every expert's tokens are split evenly over its copies."""
    copies = [0] * len(loads)
    for e in slots:
        copies[e] += 1
    out = []
    for r in range(ranks):
        lo, hi = block(len(slots), Shard(r, ranks))
        out.append(sum(loads[e] / copies[e] for e in slots[lo:hi]))
    return out


def imbalance(per_rank: Sequence[float]) -> float:
    """max / mean of the ranks' loads (1.0 is perfect; 1.0 when nothing was routed)."""
    mean = sum(per_rank) / len(per_rank) if per_rank else 0.0
    return max(per_rank) / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class Placement:
    """Every MoE layer's physical slot -> logical expert table (layer index -> slots)."""

    n_experts: int
    redundant: int
    ranks: int
    layers: dict[int, tuple[int, ...]]

    def rank_block(self, rank: int) -> tuple[int, int]:
        """[lo, hi) of the physical slots `rank` hosts (the same in every layer)."""
        return block(self.n_experts + self.redundant, Shard(rank, self.ranks))

    def to_json(self) -> dict:
        return {
            "n_experts": self.n_experts,
            "redundant": self.redundant,
            "ranks": self.ranks,
            "layers": {str(i): list(s) for i, s in self.layers.items()},
        }

    @classmethod
    def from_json(cls, d: dict) -> "Placement":
        return cls(d["n_experts"], d["redundant"], d["ranks"], {int(i): tuple(s) for i, s in d["layers"].items()})


def plan(loads: dict[int, Sequence[float]], redundant: int, ranks: int) -> Placement:
    """A placement of every layer in `loads` (layer index -> tokens per logical expert)."""
    sizes = {len(v) for v in loads.values()}
    if len(sizes) != 1:
        raise ValueError(f"every layer needs the same number of experts, not {sorted(sizes)}")
    (n,) = sizes
    refusal = eplb_refusal(n, redundant, ranks)
    if refusal:
        raise ValueError(refusal)
    return Placement(n, redundant, ranks, {i: place_layer(v, redundant, ranks) for i, v in loads.items()})


def report(loads: dict[int, Sequence[float]], placement: Placement) -> dict:
    """Per layer and overall: the ranks' max/mean load under the block placement (no EPLB) and
    under `placement`, from the same loads."""
    rows = {}
    for i, v in loads.items():
        before = imbalance(rank_loads(v, block_layer(len(v), placement.ranks), placement.ranks))
        after = imbalance(rank_loads(v, placement.layers[i], placement.ranks))
        rows[str(i)] = {"block": round(before, 4), "eplb": round(after, 4)}
    worst = {k: max((r[k] for r in rows.values()), default=1.0) for k in ("block", "eplb")}
    return {"ranks": placement.ranks, "redundant": placement.redundant, "layers": rows, "worst": worst}


def ep_flags_refusal(redundant: int, loads_file: Optional[str], tp_size: int, speculative: bool) -> Optional[str]:
    """Why --ep-redundant-experts / --ep-loads-file cannot be served (flags only), or None."""
    refusal = eplb_refusal(1, redundant, tp_size)
    if refusal:
        return refusal
    if redundant and speculative:
        return "--ep-redundant-experts does not combine with --speculative-algorithm yet (the MTP layer's experts)"
    if loads_file is not None and not redundant:
        return "--ep-loads-file places the --ep-redundant-experts copies: give --ep-redundant-experts R > 0"
    return None


def ep_checkpoint_refusal(config: dict, redundant: int) -> Optional[str]:
    """Why --ep-redundant-experts cannot place this checkpoint's experts (its config.json), or None."""
    if not redundant:
        return None
    if config.get("model_type") not in ("deepseek_v3", "deepseek_v2", "deepseek_v4"):
        return (
            f"--ep-redundant-experts places DeepSeek-V3 and V4 experts; model_type {config.get('model_type')!r} "
            "is not supported yet"
        )
    if not config.get("n_routed_experts"):
        return "--ep-redundant-experts needs a model with routed experts"
    if config.get("quantization_config"):
        return "--ep-redundant-experts does not support quantized checkpoints yet (copies are read as dense tensors)"
    return None
