"""MoE expert load counters: tokens routed to each logical expert, and computed by each physical
slot (an expert's copy under --ep-redundant-experts), per MoE layer, since the engine started.

Counted on the device inside the forward (an accumulating index_put_ per layer: no host read, capturable), read
only when asked: `/metrics` (`publish`, before each render), `GET /admin/expert_loads` and
/v1/loads (`table`), and the balancer (dsv4_engine.parallel.eplb_apply). A decode step replayed from
a CUDA graph counts its padding rows too (the graph's fixed batch): approximate on that path.
"""

from __future__ import annotations

from typing import Optional

import torch

from dsv4_wire.metrics import EXPERT_SERIES_MAX

LOADS_FORMAT = "dsv4.expert_loads.v1"  # the table's (and a --ep-loads-file's) format tag


class ExpertLoads:
    def __init__(
        self,
        layers: list[int],
        n_experts: int,
        n_slots: int,
        slot_ranks: list[int],
        device,
        routing: Optional[list[str]] = None,
    ):
        self.layers = list(layers)  # decoder layer index of each row
        # each row's router: "learned", or "hash" (V4's first layers: experts fixed by the token id)
        self.routing = list(routing) if routing is not None else ["learned"] * len(self.layers)
        self.n_experts = n_experts
        self.slot_ranks = list(slot_ranks)  # rank hosting each physical slot (the same in every layer)
        # Steps routed with one copy per expert in expert order (no placement) count once, in
        # `plain`: there slot e is expert e. Placed steps count both views.
        self.plain = torch.zeros(len(layers), n_experts, dtype=torch.int64, device=device)
        self.placed_logical = torch.zeros(len(layers), n_experts, dtype=torch.int64, device=device)
        self.placed_physical = torch.zeros(len(layers), n_slots, dtype=torch.int64, device=device)
        self._published: dict = {}  # series key -> value already added to its Prometheus counter
        # Made once: each layer's rows as views, and the 1 every choice adds (an accumulating
        # index_put_ of a scalar: one dispatch a count, which the decode graph's budget counts).
        self._plain_rows = list(self.plain.unbind(0))
        self._placed_rows = list(zip(self.placed_logical.unbind(0), self.placed_physical.unbind(0)))
        self._one = torch.ones((), dtype=torch.int64, device=device)

    def record(self, row: int, ids: torch.Tensor, slots: Optional[torch.Tensor] = None) -> None:
        """One layer's routing of one step: ids (logical) and slots (physical), both [T, k];
        slots None: the plain mapping (slot = expert)."""
        if slots is None:
            self._plain_rows[row].index_put_((ids,), self._one, accumulate=True)
            return
        logical, physical = self._placed_rows[row]
        logical.index_put_((ids,), self._one, accumulate=True)
        physical.index_put_((slots,), self._one, accumulate=True)

    @property
    def logical(self) -> torch.Tensor:
        """[layers, experts]: tokens routed to each logical expert."""
        return self.plain + self.placed_logical

    @property
    def physical(self) -> torch.Tensor:
        """[layers, slots]: tokens each physical slot computed."""
        out = self.placed_physical.clone()
        out[:, : self.n_experts] += self.plain
        return out

    def host(self) -> tuple[list[list[int]], list[list[int]]]:
        return self.logical.cpu().tolist(), self.physical.cpu().tolist()

    def table(self) -> dict:
        """Every layer's tokens per logical expert and per rank: the JSON that `--ep-loads-file`
        reads back (dsv4_engine.parallel.eplb_apply.loads_from_table)."""
        logical, physical = self.host()
        ranks = max(self.slot_ranks) + 1 if self.slot_ranks else 1
        out = {}
        for row, layer in enumerate(self.layers):
            per_rank = [0] * ranks
            for slot, n in enumerate(physical[row]):
                per_rank[self.slot_ranks[slot]] += n
            out[str(layer)] = {"experts": logical[row], "ranks": per_rank, "routing": self.routing[row]}
        return {"format": LOADS_FORMAT, "n_experts": self.n_experts, "layers": out}

    def summary(self) -> dict:
        """Per layer: routed choices and max/mean over the experts and over the ranks."""
        t = self.table()["layers"]
        return {
            layer: {
                "routing": row["routing"],
                "routed": sum(row["experts"]),
                "expert_max_over_mean": round(_max_over_mean(row["experts"]), 4),
                "rank_max_over_mean": round(_max_over_mean(row["ranks"]), 4),
            }
            for layer, row in t.items()
        }

    def publish(self, metrics) -> None:
        """Bring the Prometheus series up to the counters (EngineMetrics.before_render)."""
        logical, physical = self.host()
        per_expert = len(self.layers) * self.n_experts <= EXPERT_SERIES_MAX
        ranks = max(self.slot_ranks) + 1 if self.slot_ranks else 1
        labels = metrics.labels
        for row, layer in enumerate(self.layers):
            counts = logical[row]
            total = sum(counts)
            self._add(metrics.layer_counters["moe_layer_routed_tokens"], (layer,), total, labels)
            metrics.layer_gauges["moe_expert_load_imbalance"].labels(**labels, layer=str(layer)).set(
                _max_over_mean(counts)
            )
            per_rank = [0] * ranks
            for slot, n in enumerate(physical[row]):
                per_rank[self.slot_ranks[slot]] += n
            metrics.layer_gauges["moe_rank_load_imbalance"].labels(**labels, layer=str(layer)).set(
                _max_over_mean(per_rank)
            )
            if per_expert:
                counter = metrics.expert_counters["moe_expert_tokens"]
                for e, n in enumerate(counts):
                    self._add(counter, (layer, e), n, labels)

    def _add(self, counter, key: tuple, value: int, labels: dict) -> None:
        """Counters only grow by what was not added yet (a scrape adds the delta)."""
        full = (id(counter), *key)
        delta = value - self._published.get(full, 0)
        if delta > 0 or full not in self._published:
            names = ("layer", "expert")[: len(key)]
            counter.labels(**labels, **{n: str(v) for n, v in zip(names, key)}).inc(max(delta, 0))
            self._published[full] = value


def _max_over_mean(counts: list[int]) -> float:
    total = sum(counts)
    return max(counts) * len(counts) / total if total else 1.0
