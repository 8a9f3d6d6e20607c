"""Pure: one round of the planner — the engines' loads in, replica counts and the next state out.

Per role, every interval:

1. Fit: the role's performance model (model.py) takes the interval's step totals, and its
   latency correction the TTFT (prefill) or ITL (decode) the engines measured.
2. Demand: prefill's is prompt tokens per second (arrivals, plus the queued prompt tokens to be
   worked off within an interval); decode's is generated tokens per second (plus the requests
   waiting on a decode engine, in proportion). The forecaster (forecast.py) takes it.
3. Capacity of one replica at the targets: decode, the tokens per second of the largest batch
   whose ITL meets the target and whose context fits the KV cache; prefill, the prompt tokens
   per second it prefills, at most as busy as its queueing allows for the TTFT target.
4. Counts: up = the replicas for the larger of the load now and the forecast one start-up time
   ahead, at `targetUtilization`; down = for the load now and the next interval's forecast at
   `targetUtilization x (1 - hysteresis)`. Prefill and decode are sized separately: each one's
   cost is its replicas and its demand does not depend on the other's count, so the fewest of
   each is the cheapest pair.
5. Act: scale up at once (replicas already starting count as capacity); scale down only when
   every decision of the cool-down window allows it, the cool-down since the role's last change
   has passed, no pod of the role is being remediated, and never by more than maxUnavailable
   pods less those already unavailable (the PodDisruptionBudget's number). A scale-down first
   drains the pods that go (the highest ordinals, as a StatefulSet removes them): the shell
   takes them out of the routers and asks them to drain, and the count drops once they are idle
   or `drainTimeoutSeconds` passed (what is left then migrates). A role in a rollout or a canary
   probe is paused: the model learns, nothing is changed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Optional

from dsv4_operator.planner.baseline import next_baseline
from dsv4_operator.planner.forecast import Holt
from dsv4_operator.planner.model import (
    DecodeCapacity,
    ModelState,
    PrefillCapacity,
    RoleModel,
    decode_capacity,
    decode_features,
    prefill_capacity,
    prefill_features,
    prefill_service_s,
    queueing_ttft_s,
    smoothed_ratio,
    steps_observation,
)
from dsv4_operator.planner.observe import EngineLoad

ROLES = ("prefill", "decode")
SCALE_UP, SCALE_DOWN, DRAIN, HOLD, WAIT = "scale_up", "scale_down", "drain", "hold", "wait"
KV_SHARE = 0.95  # the share of a replica's KV cache the planner plans to fill
CONTEXT_SMOOTHING = 0.5
MIN_LATENCY_SAMPLES = 5  # an interval's mean TTFT/ITL counts towards the correction from this many requests
MAX_PREDICTED_UTILIZATION = 0.95  # a busier engine's queueing tells little about the model


@dataclass(frozen=True)
class Settings:
    interval_s: float = 30.0
    ttft_target_s: float = 2.0
    itl_target_s: float = 0.05
    min_replicas: Mapping[str, int] = field(default_factory=lambda: {"prefill": 1, "decode": 1})
    max_replicas: Mapping[str, int] = field(default_factory=lambda: {"prefill": 8, "decode": 8})
    target_utilization: float = 0.8
    hysteresis: float = 0.15
    scale_down_cooldown_s: float = 300.0
    startup_s: float = 180.0
    drain_timeout_s: float = 120.0
    burst_factor: float = 1.0
    max_unavailable: Mapping[str, int] = field(default_factory=lambda: {"prefill": 1, "decode": 1})
    dry_run: bool = False

    @classmethod
    def from_spec(cls, spec: Any) -> "Settings":
        """From a DSV4DeploymentSpec (its planner section, defaults when absent, and the
        PodDisruptionBudgets' maxUnavailable)."""
        p = spec.planner_settings()
        mu = spec.remediation.max_unavailable
        return cls(
            interval_s=float(p.interval_seconds),
            ttft_target_s=float(p.ttft_target_seconds),
            itl_target_s=float(p.itl_target_seconds),
            min_replicas={"prefill": p.prefill.min_replicas, "decode": p.decode.min_replicas},
            max_replicas={"prefill": p.prefill.max_replicas, "decode": p.decode.max_replicas},
            target_utilization=float(p.target_utilization),
            hysteresis=float(p.hysteresis),
            scale_down_cooldown_s=float(p.scale_down_cooldown_seconds),
            startup_s=float(p.startup_seconds),
            drain_timeout_s=float(p.drain_timeout_seconds),
            burst_factor=float(p.burst_factor),
            max_unavailable={"prefill": mu.prefill, "decode": mu.decode},
            dry_run=bool(p.dry_run),
        )


@dataclass(frozen=True)
class RoleObservation:
    """A role as the shell sees it this round."""

    role: str
    replicas: int  # the workload's count now (pods asked for, ready or not)
    statefulset: str  # its pods are <statefulset>-<ordinal>
    engines: tuple[EngineLoad, ...] = ()  # every engine pod of the role that answered
    ready: int = 0  # pods Ready now
    paused: Optional[str] = None  # why the count may not change now (a rollout, a canary probe)
    remediating: tuple[str, ...] = ()  # pods the watchdog is remediating
    planned: bool = True  # scaling: planner; other roles are only observed (their model still learns)


@dataclass(frozen=True)
class Drain:
    pods: tuple[str, ...]
    target: int
    started_at: float


@dataclass(frozen=True)
class RoleState:
    demand: Holt = field(default_factory=Holt)  # the demand, smoothed
    base: Holt = field(default_factory=Holt)  # the baseline (the demand without bursts) and its trend
    size: Optional[float] = None  # decode: mean context of a running request; prefill: mean prompt length
    token_context: Optional[float] = None  # prefill: the mean context a prompt token is computed with
    largest_step: Optional[float] = None  # decode: the largest mean batch seen (the fit's trusted range)
    queued_tokens: Optional[float] = None
    last_change_at: Optional[float] = None
    last_up_at: Optional[float] = None  # the last scale-up (or the first round): the cool-down counts from it
    allowed_down: tuple[tuple[float, int], ...] = ()  # (time, count a scale-down could go to then)
    drain: Optional[Drain] = None
    asked_up: Optional[tuple[float, int]] = None  # (time, count) of the last scale-up not yet ready
    startup_measured_s: Optional[float] = None
    last_reason: Optional[str] = None


@dataclass(frozen=True)
class PlannerState:
    models: ModelState = field(default_factory=ModelState)
    roles: Mapping[str, RoleState] = field(default_factory=lambda: {r: RoleState() for r in ROLES})

    def role(self, role: str) -> RoleState:
        return self.roles.get(role) or RoleState()


@dataclass(frozen=True)
class RoleDecision:
    role: str
    action: str  # scale_up, scale_down, drain, hold, wait
    replicas: int  # the count now
    target: int  # the count this decision leads to
    reason: str
    drain: tuple[str, ...] = ()  # pods to drain now (action drain)
    numbers: Mapping[str, Any] = field(default_factory=dict)
    dry_run: bool = False
    kind: str = ""  # the reason's kind (steady, cooldown, budget, ...): an Event is posted when it changes

    @property
    def key(self) -> tuple[str, str, int]:
        """What makes a decision news: its action, the kind of its reason and its target."""
        return (self.action, self.kind, self.target)

    @property
    def changes(self) -> bool:
        return self.action in (SCALE_UP, SCALE_DOWN, DRAIN)

    def message(self) -> str:
        """The Event's text: what was decided, and the numbers it was decided from."""
        n = self.numbers
        head = {
            SCALE_UP: f"{self.role} {self.replicas} -> {self.target}",
            SCALE_DOWN: f"{self.role} {self.replicas} -> {self.target}",
            DRAIN: f"{self.role} {self.replicas} -> {self.target}: draining {', '.join(self.drain)}",
            WAIT: f"{self.role} {self.replicas} (-> {self.target} once drained)",
            HOLD: f"{self.role} stays at {self.replicas}",
        }[self.action]
        parts = [("dry run: " if self.dry_run else "") + head, self.reason]
        if "demand" in n:
            unit = "prompt tok/s" if self.role == "prefill" else "gen tok/s"
            parts.append(
                f"demand {n['demand']:.0f} {unit} now, forecast {n['forecast']:.0f} over {n['horizon_s']:.0f}s"
                + (f", burst reserve {n['reserve']:.0f}" if n.get("reserve") else "")
            )
        if "capacity" in n:
            parts.append(f"per replica {n['capacity']}")
        if "need_up" in n:
            parts.append(f"needs {n['need_up']} (up) / {n['need_down']} (down) at {n['utilization']:.0%}")
        if n.get("measured_s") is not None:
            what = "TTFT" if self.role == "prefill" else "ITL"
            parts.append(
                f"{what} measured {n['measured_s']:.3f}s vs target {n['target_s']:.3f}s (model correction {n['correction']:.2f})"
            )
        return "; ".join(parts)


@dataclass(frozen=True)
class Decision:
    roles: Mapping[str, RoleDecision]
    state: PlannerState


# ---- the model's update ------------------------------------------------------------------------


def _weighted_mean(pairs: Iterable[tuple[Optional[float], float]]) -> Optional[float]:
    num = den = 0.0
    for value, weight in pairs:
        if value is not None and weight > 0:
            num += value * weight
            den += weight
    return num / den if den > 0 else None


def _update_decode(model: RoleModel, engines: Iterable[EngineLoad]) -> tuple[RoleModel, Optional[float]]:
    """The decode model after one interval; returns it and the ITL the engines measured."""
    fit = model.fit
    measured: list[tuple[float, float]] = []
    predicted: list[tuple[float, float]] = []
    for e in engines:
        if e.seconds <= 0:
            continue
        obs = steps_observation(e.steps.get("decode") or {}, "decode")
        if obs is not None:
            features, step_s, steps = obs
            fit = fit.update(features, step_s, steps)
        elif e.itl_s is not None and e.itl_n >= MIN_LATENCY_SAMPLES and e.running > 0:
            fit = fit.update(decode_features(e.running, e.context or 1.0), e.itl_s, e.itl_n)
        if e.itl_s is not None and e.itl_n >= MIN_LATENCY_SAMPLES:
            batch = (obs[0][1] if obs else e.running) or 1.0
            context = (obs[0][2] / batch if obs else e.context) or 1.0
            measured.append((e.itl_s, e.itl_n))
            predicted.append((fit.predict(decode_features(batch, context)), e.itl_n))
    m, p = _weighted_mean(measured), _weighted_mean(predicted)
    return RoleModel(fit, smoothed_ratio(model.correction, m, p)), m


def _update_prefill(
    model: RoleModel,
    engines: Iterable[EngineLoad],
    max_batched_tokens: Optional[float],
    prompt_len: Optional[float],
    context: Optional[float],
) -> tuple[RoleModel, Optional[float]]:
    """The prefill model after one interval; returns it and the TTFT the engines measured."""
    fit = model.fit
    measured: list[tuple[float, float]] = []
    predicted: list[tuple[float, float]] = []
    engines = list(engines)
    for e in engines:
        if e.seconds <= 0:
            continue
        obs = steps_observation(e.steps.get("prefill") or {}, "prefill")
        if obs is not None:
            features, step_s, steps = obs
            fit = fit.update(features, step_s, steps)
        elif (
            e.ttft_s is not None and e.ttft_n >= MIN_LATENCY_SAMPLES and prompt_len and not e.waiting
        ):  # no step totals (SGLang): an engine with nothing queued took about one step per prompt
            fit = fit.update(prefill_features(prompt_len, prompt_len * prompt_len), e.ttft_s, e.ttft_n)
    for e in engines:
        if e.seconds <= 0 or e.ttft_s is None or e.ttft_n < MIN_LATENCY_SAMPLES or not prompt_len:
            continue
        raw = RoleModel(fit, 1.0)
        cap = prefill_capacity(raw, math.inf, prompt_len, max_batched_tokens, context)
        rho = (e.prompt_tokens_per_s or 0.0) / cap.tokens_per_s if cap.tokens_per_s > 0 else 1.0
        if rho >= MAX_PREDICTED_UTILIZATION:
            continue
        measured.append((e.ttft_s, e.ttft_n))
        predicted.append((queueing_ttft_s(prefill_service_s(raw, prompt_len, context), rho), e.ttft_n))
    m, p = _weighted_mean(measured), _weighted_mean(predicted)
    return RoleModel(fit, smoothed_ratio(model.correction, m, p)), m


# ---- demand and counts ------------------------------------------------------------------------


def _largest_batch(engines: Iterable[EngineLoad], previous: Optional[float]) -> Optional[float]:
    """The largest mean decode batch of the interval's engines (requests per step, or the running
    batch of an engine without step totals), if above `previous`."""
    sizes = []
    for e in engines:
        totals = e.steps.get("decode") or {}
        steps = float(totals.get("steps") or 0)
        if steps > 0:
            sizes.append(float(totals.get("requests") or 0) / steps)
        elif e.running > 0 and e.itl_n >= MIN_LATENCY_SAMPLES:
            sizes.append(e.running)
    return max([s for s in sizes if s > 0] + ([previous] if previous else []), default=None)


def _smooth(previous: Optional[float], value: Optional[float]) -> Optional[float]:
    if value is None or value <= 0:
        return previous
    if previous is None:
        return value
    return CONTEXT_SMOOTHING * value + (1 - CONTEXT_SMOOTHING) * previous


def _first(values: Iterable[Optional[float]], pick: Any = min) -> Optional[float]:
    known = [v for v in values if v is not None and v > 0]
    return pick(known) if known else None


def replicas_for(demand: float, per_replica: float, utilization: float, lo: int, hi: int) -> int:
    """The fewest replicas, within [lo, hi], that serve `demand` with each one at most
    `utilization` of `per_replica`; hi when one replica serves nothing at the target."""
    if demand <= 0:
        return lo
    if per_replica <= 0 or utilization <= 0:
        return hi
    return min(hi, max(lo, math.ceil(demand / (per_replica * utilization) - 1e-9)))


@dataclass(frozen=True)
class _Sizing:
    demand: float
    forecast: float
    reserve: float
    horizon_s: float
    capacity: float  # the unit of demand one replica serves at the targets (before the utilization)
    capacity_text: str
    utilization: float  # the utilization the up count is planned at
    need_up: int
    need_down: int
    measured_s: Optional[float]
    target_s: float
    correction: float


def baseline(rs: RoleState) -> float:
    """The role's load without a burst in it (baseline.py, or as the caller knows it)."""
    return rs.base.last or 0.0


def _size_role(
    role: str,
    obs: RoleObservation,
    model: RoleModel,
    rs: RoleState,
    settings: Settings,
    demand_now: float,
    measured_s: Optional[float],
    horizon_s: float,
    now: float,
) -> _Sizing:
    lo, hi = settings.min_replicas[role], settings.max_replicas[role]
    intervals_ahead = horizon_s / settings.interval_s if settings.interval_s > 0 else 1.0
    # The forecast is the baseline's trend (a day's rise, not a burst's) carried one start-up ahead
    # (replicas asked for now serve then), applied to the load now.
    base = baseline(rs)
    level = rs.demand.level or demand_now
    growth = max(1.0, rs.base.forecast(intervals_ahead) / base) if base > 0 else 1.0
    forecast = max(level, base) * growth
    # The burst reserve: capacity at the targets themselves (utilization 1, it is the worst case,
    # not the expected load) for burstFactor x the baseline one start-up ahead.
    reserve = settings.burst_factor * base * growth if settings.burst_factor > 1 else 0.0
    # A load within the reserve is what the reserve is for: it is served at the targets by the
    # replicas running, with no scale-up that would come after the burst; a load beyond it is
    # sized as any other, at targetUtilization.
    up_demand = max(base * growth, forecast if level > reserve else 0.0)
    now_load = max(level, demand_now)
    down_demand = max(base, now_load if now_load > reserve else 0.0)
    u = settings.target_utilization
    if role == "decode":
        kv = _first(e.kv_tokens_total for e in obs.engines)
        cap: DecodeCapacity | PrefillCapacity = decode_capacity(
            model,
            settings.itl_target_s,
            rs.size or 1.0,
            kv * KV_SHARE if kv else None,
            _first(e.max_batch for e in obs.engines),
            rs.largest_step,
        )
        per, text, util = cap.tokens_per_s, cap.describe(), u
        target_s = settings.itl_target_s
    else:
        cap = prefill_capacity(
            model,
            settings.ttft_target_s,
            rs.size or 1.0,
            _first(e.max_batched_tokens for e in obs.engines),
            rs.token_context,
        )
        per, text, util = cap.tokens_per_s, cap.describe(), min(u, cap.max_utilization)
        target_s = settings.ttft_target_s
    down_util = util * (1 - settings.hysteresis)
    # The reserve is the worst case, planned at the targets themselves for decode (its ITL at a
    # batch is what the fit predicts well); for prefill at no more than targetUtilization: its
    # queue's tail grows steeply near the utilization the TTFT target allows, and a capacity
    # estimated a little high there (prompt lengths move with the mix) lets the queue run away.
    burst_util = 1.0 if role == "decode" else util
    return _Sizing(
        demand=demand_now,
        forecast=forecast,
        reserve=reserve,
        horizon_s=horizon_s,
        capacity=per,
        capacity_text=text,
        utilization=util,
        need_up=max(replicas_for(up_demand, per, util, lo, hi), replicas_for(reserve, per, burst_util, lo, hi)),
        need_down=max(
            replicas_for(down_demand, per, down_util, lo, hi),
            replicas_for(up_demand, per, util, lo, hi),
            replicas_for(reserve, per, burst_util, lo, hi),
        ),
        measured_s=measured_s,
        target_s=target_s,
        correction=model.correction,
    )


def _demand(role: str, obs: RoleObservation, rs: RoleState) -> tuple[float, Optional[float], Optional[float]]:
    """(demand now, the role's size measure this interval, queued prompt tokens now)."""
    engines = [e for e in obs.engines if e.seconds > 0]
    interval = max((e.seconds for e in engines), default=0.0)
    if role == "prefill":
        arrivals = sum(e.prompt_tokens_per_s or 0.0 for e in engines)
        queued = sum(e.queued_prompt_tokens or 0.0 for e in obs.engines)
        backlog = queued / interval if interval > 0 else 0.0
        tokens = sum((e.prompt_tokens_per_s or 0.0) * e.seconds for e in engines)
        requests = sum(e.ttft_n for e in engines)
        size = tokens / requests if requests > 0 and tokens > 0 else None
        return arrivals + backlog, size, queued
    generated = sum(e.generation_tokens_per_s or 0.0 for e in engines)
    running = sum(e.running for e in obs.engines)
    waiting = sum(e.waiting for e in obs.engines)
    if waiting > 0 and running > 0:  # streams waiting for a place in a batch want tokens too
        generated *= (running + waiting) / running
    contexts = [(e.context, e.running) for e in obs.engines if e.context]
    return generated, _weighted_mean(contexts), None


# ---- the round --------------------------------------------------------------------------------


def decide_role(
    obs: RoleObservation, state: PlannerState, settings: Settings, now: float, burst_free: Optional[float] = None
) -> tuple[Optional[RoleDecision], RoleState, RoleModel]:
    role = obs.role
    rs = state.role(role)
    model = state.models.role(role)
    demand_now, size, queued = _demand(role, obs, rs)
    rs = replace(rs, size=_smooth(rs.size, size), queued_tokens=queued)
    if role == "decode":
        rs = replace(rs, largest_step=_largest_batch(obs.engines, rs.largest_step))
    if role == "prefill":
        totals = [e.steps.get("prefill") or {} for e in obs.engines]
        tokens = sum(float(t.get("tokens") or 0) for t in totals)
        token_ctx = sum(float(t.get("token_context") or 0) for t in totals)
        rs = replace(rs, token_context=_smooth(rs.token_context, token_ctx / tokens if tokens > 0 else None))
    if rs.last_up_at is None:  # the first round counts as a scale-up: a cool-down before any scale-down
        rs = replace(rs, last_up_at=now)
    if role == "decode":
        model, measured = _update_decode(model, obs.engines)
    else:
        model, measured = _update_prefill(
            model, obs.engines, _first(e.max_batched_tokens for e in obs.engines), rs.size, rs.token_context
        )
    fresh = any(e.seconds > 0 for e in obs.engines)
    if fresh:
        rs = replace(rs, demand=rs.demand.observe(demand_now))
        known = burst_free if burst_free is not None else next_baseline(rs.base.last, rs.demand.level, demand_now)
        rs = replace(rs, base=rs.base.observe(known))
    # Start-ups: a scale-up is ready when that many pods are; the time it took is remembered.
    if rs.asked_up is not None and obs.ready >= rs.asked_up[1]:
        rs = replace(rs, startup_measured_s=now - rs.asked_up[0], asked_up=None)
    startup = max(settings.startup_s, rs.startup_measured_s or 0.0)
    sizing = _size_role(role, obs, model, rs, settings, demand_now, measured, startup + settings.interval_s, now)
    numbers: dict[str, Any] = {
        "demand": sizing.demand,
        "forecast": sizing.forecast,
        "reserve": sizing.reserve,
        "horizon_s": sizing.horizon_s,
        "capacity": sizing.capacity_text,
        "capacity_per_replica": sizing.capacity,
        "utilization": sizing.utilization,
        "need_up": sizing.need_up,
        "need_down": sizing.need_down,
        "measured_s": sizing.measured_s,
        "target_s": sizing.target_s,
        "correction": sizing.correction,
        "ready": obs.ready,
    }
    if not obs.planned:
        return None, rs, model
    n = obs.replicas
    window = tuple((t, c) for t, c in rs.allowed_down if now - t < settings.scale_down_cooldown_s) + (
        (now, sizing.need_down),
    )
    rs = replace(rs, allowed_down=window)

    def decision(action: str, target: int, reason: str, kind: str, drain: tuple[str, ...] = ()) -> RoleDecision:
        return RoleDecision(role, action, n, target, reason, drain, numbers, settings.dry_run, kind)

    # A drain under way finishes first: its pods no longer take requests, whatever the load does now.
    if rs.drain is not None:
        d = rs.drain
        busy = [e.pod for e in obs.engines if e.pod in d.pods and (e.running > 0 or e.waiting > 0)]
        waited = now - d.started_at
        if busy and waited < settings.drain_timeout_s:
            why = (
                f"draining: {', '.join(busy)} still serving ({waited:.0f}s of at most {settings.drain_timeout_s:.0f}s)"
            )
            return decision(WAIT, d.target, why, "draining"), rs, model
        why = f"drained {', '.join(d.pods)}" + (
            f" (timeout: {', '.join(busy)} still had requests, they migrate)" if busy else " (idle)"
        )
        rs = replace(rs, drain=None, last_change_at=now)
        return decision(SCALE_DOWN, d.target, why, "drained"), rs, model
    if obs.paused:
        return decision(HOLD, n, f"paused: {obs.paused}", "paused"), rs, model
    lo, hi = settings.min_replicas[role], settings.max_replicas[role]
    if n < lo or sizing.need_up > n:
        target = max(lo, min(hi, max(n, sizing.need_up)))
        if target > n:
            why = (
                f"below minReplicas {lo}"
                if n < lo and sizing.need_up <= lo
                else "load above what the replicas serve at the targets"
            )
            if not settings.dry_run:
                rs = replace(rs, last_change_at=now, last_up_at=now, asked_up=(now, target))
            return decision(SCALE_UP, target, why, "load"), rs, model
    allowed = max(c for _, c in window)
    over_max = n > hi
    target = hi if over_max else min(hi, max(lo, allowed))
    if target >= n:
        if sizing.need_down < n:
            why = (
                f"a scale-down to {max(lo, sizing.need_down)} needs the load that low for the whole cool-down window "
                f"({settings.scale_down_cooldown_s:.0f}s; the highest need in it is {allowed})"
            )
            return decision(HOLD, n, why, "stabilizing"), rs, model
        return decision(HOLD, n, "the replicas serve the load at the targets", "steady"), rs, model
    if not over_max:
        since = now - (rs.last_up_at if rs.last_up_at is not None else now)
        if since < settings.scale_down_cooldown_s:
            why = (
                f"cool-down: last scale-up (or start) {since:.0f}s ago, of {settings.scale_down_cooldown_s:.0f}s; "
                f"would go to {target}"
            )
            return decision(HOLD, n, why, "cooldown"), rs, model
    if obs.remediating:
        why = f"remediation in progress on {', '.join(obs.remediating)}: no scale-down to {target}"
        return decision(HOLD, n, why, "remediation"), rs, model
    unavailable = max(0, n - obs.ready)
    budget = settings.max_unavailable.get(role, 1) - unavailable
    if budget <= 0:
        why = (
            f"disruption budget: {unavailable} of {n} unavailable, maxUnavailable "
            f"{settings.max_unavailable.get(role, 1)}: no scale-down to {target} now"
        )
        return decision(HOLD, n, why, "budget"), rs, model
    target = max(target, n - budget)
    pods = tuple(f"{obs.statefulset}-{i}" for i in range(n - 1, target - 1, -1))
    why = "replicas above maxReplicas" if over_max else "load fits fewer replicas"
    kind = "over_max" if over_max else "load"
    if settings.dry_run:
        return decision(DRAIN if settings.drain_timeout_s > 0 else SCALE_DOWN, target, why, kind, pods), rs, model
    if settings.drain_timeout_s <= 0:
        rs = replace(rs, last_change_at=now)
        return decision(SCALE_DOWN, target, why + " (no drain: drainTimeoutSeconds 0)", kind), rs, model
    rs = replace(rs, drain=Drain(pods, target, now))
    return decision(DRAIN, target, why, kind, pods), rs, model


def decide(
    observations: Mapping[str, RoleObservation],
    state: PlannerState,
    settings: Settings,
    now: float,
    burst_free: Optional[Mapping[str, float]] = None,
) -> Decision:
    """One round of the planner for every role observed (see the module's docstring).
    `burst_free`: each role's load without bursts where the caller knows it exactly (the planner's
    benchmark does, from its trace: the bound of a perfect burst filter); otherwise estimated."""
    roles: dict[str, RoleDecision] = {}
    role_states = dict(state.roles)
    models = state.models
    for role in ROLES:
        obs = observations.get(role)
        if obs is None:
            continue
        known = (burst_free or {}).get(role)
        decided, rs, model = decide_role(obs, PlannerState(models, role_states), settings, now, known)
        role_states[role] = replace(rs, last_reason=decided.reason if decided else rs.last_reason)
        models = models.with_role(role, model)
        if decided is not None:
            roles[role] = decided
    return Decision(roles, PlannerState(models, role_states))
