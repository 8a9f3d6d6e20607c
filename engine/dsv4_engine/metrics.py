"""The engine's Prometheus metrics (names follow SGLang's, prefix `dsv4:`), on a registry of
its own so several engines can live in one process (tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dsv4_wire.metrics import (
    COUNT_BUCKETS,
    COUNT_HISTOGRAMS,
    COUNTERS,
    EXPERT_COUNTERS,
    EXPERT_LABEL,
    GAUGES,
    HISTOGRAMS,
    LAYER_COUNTERS,
    LAYER_GAUGES,
    LAYER_LABEL,
    PREFIX,
    RANK_COUNTERS,
    RANK_GAUGES,
    RANK_LABEL,
    STATE_GAUGES,
    STATE_LABEL,
    TIER_COUNTERS,
    TIER_GAUGES,
    TIER_LABEL,
)
from dsv4_wire.kv_events import TIERS

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class EngineMetrics:
    def __init__(self, role: str, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["role", "model_name"]
        self.labels = {"role": role, "model_name": model_name}
        self.gauges = {
            k: Gauge(f"{PREFIX}{k}", d, labels, registry=self.registry).labels(**self.labels) for k, d in GAUGES.items()
        }
        self.counters = {
            k: Counter(f"{PREFIX}{k}", d, labels, registry=self.registry).labels(**self.labels)
            for k, d in COUNTERS.items()
        }
        self.histograms = {
            k: Histogram(f"{PREFIX}{k}", d, labels, buckets=LATENCY_BUCKETS, registry=self.registry).labels(
                **self.labels
            )
            for k, d in HISTOGRAMS.items()
        }
        self.histograms.update(
            {
                k: Histogram(f"{PREFIX}{k}", d, labels, buckets=COUNT_BUCKETS, registry=self.registry).labels(
                    **self.labels
                )
                for k, d in COUNT_HISTOGRAMS.items()
            }
        )
        self.state_gauges = {
            k: Gauge(f"{PREFIX}{k}", d, [*labels, STATE_LABEL], registry=self.registry) for k, d in STATE_GAUGES.items()
        }
        # One child per tier, made up front so every tier's series exists from the start (0).
        self.tier_gauges = {}
        for k, d in TIER_GAUGES.items():
            g = Gauge(f"{PREFIX}{k}", d, [*labels, TIER_LABEL], registry=self.registry)
            self.tier_gauges[k] = {t: g.labels(**self.labels, **{TIER_LABEL: t}) for t in TIERS}
        self.tier_counters = {}
        for k, d in TIER_COUNTERS.items():
            c = Counter(f"{PREFIX}{k}", d, [*labels, TIER_LABEL], registry=self.registry)
            self.tier_counters[k] = {t: c.labels(**self.labels, **{TIER_LABEL: t}) for t in TIERS}
        # --dp-size N: one child per attention rank, made when the engine first sets it.
        self.rank_gauges = {
            k: Gauge(f"{PREFIX}{k}", d, [*labels, RANK_LABEL], registry=self.registry) for k, d in RANK_GAUGES.items()
        }
        self.rank_counters = {
            k: Counter(f"{PREFIX}{k}", d, [*labels, RANK_LABEL], registry=self.registry)
            for k, d in RANK_COUNTERS.items()
        }
        # MoE expert loads (dsv4_engine.expert_loads publishes them before each render).
        self.layer_gauges = {
            k: Gauge(f"{PREFIX}{k}", d, [*labels, LAYER_LABEL], registry=self.registry) for k, d in LAYER_GAUGES.items()
        }
        self.layer_counters = {
            k: Counter(f"{PREFIX}{k}", d, [*labels, LAYER_LABEL], registry=self.registry)
            for k, d in LAYER_COUNTERS.items()
        }
        self.expert_counters = {
            k: Counter(f"{PREFIX}{k}", d, [*labels, LAYER_LABEL, EXPERT_LABEL], registry=self.registry)
            for k, d in EXPERT_COUNTERS.items()
        }
        # Called before every render: sources read at scrape time, not every step.
        self.before_render: list = []
        # Plain mirrors of the counters so /v1/loads can report them without parsing.
        self.totals = {k: 0.0 for k in COUNTERS}
        # The engine sets every gauge once per step and most do not move between steps: what was
        # last set, so an unchanged value costs a dict lookup instead of a locked write.
        self._last: dict = {}
        self._state_children: dict = {}  # (name, state) -> that labelled gauge, made once

    def inc(self, name: str, amount: float = 1.0) -> None:
        self.counters[name].inc(amount)
        self.totals[name] += amount

    def set(self, name: str, value: float) -> None:
        if self._last.get(name) != value:
            self.gauges[name].set(value)
            self._last[name] = value

    def set_state(self, name: str, state: str, value: float) -> None:
        """A per-state gauge (STATE_GAUGES), e.g. bytes per token of one state."""
        key = (name, state)
        if self._last.get(key) == value:
            return
        child = self._state_children.get(key)
        if child is None:
            child = self._state_children[key] = self.state_gauges[name].labels(**self.labels, **{STATE_LABEL: state})
        child.set(value)
        self._last[key] = value

    def set_tier(self, name: str, tier: str, value: float) -> None:
        """A per-tier gauge (TIER_GAUGES)."""
        if self._last.get((name, tier)) != value:
            self.tier_gauges[name][tier].set(value)
            self._last[(name, tier)] = value

    def inc_tier(self, name: str, tier: str, amount: float) -> None:
        """A per-tier counter (TIER_COUNTERS)."""
        self.tier_counters[name][tier].inc(amount)

    def set_rank(self, name: str, rank: int, value: float) -> None:
        """A per-rank gauge (RANK_GAUGES, --dp-size N)."""
        if self._last.get((name, rank)) != value:
            self.rank_gauges[name].labels(**self.labels, **{RANK_LABEL: str(rank)}).set(value)
            self._last[(name, rank)] = value

    def inc_rank(self, name: str, rank: int, amount: float) -> None:
        """A per-rank counter (RANK_COUNTERS, --dp-size N)."""
        self.rank_counters[name].labels(**self.labels, **{RANK_LABEL: str(rank)}).inc(amount)

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)

    def render(self) -> bytes:
        for publish in self.before_render:
            publish(self)
        return generate_latest(self.registry)
