"""Pure: the planner's performance model of an engine, fitted online.

A forward step's time is linear in a few terms of its size (dsv4_engine.step_tally):

- decode step:  a + b * batch + c * (batch x context)          (weights, per request, KV read)
- prefill step: p0 + p1 * tokens + p2 * (tokens x context)      (weights, per token, attention)

so recursive least squares fits the coefficients from the engines' running totals: between two
reads of an engine, the step count, seconds and term sums give one observation of the mean step
(the mean of a linear model is the model of the means). A prior keeps the fit sane before the
engines have seen varied batches, and a forgetting factor lets it follow a changed engine.

Engines that report no step totals (SGLang) are fitted from their measured ITL (decode) and the
TTFT of an idle engine (prefill) instead. Either way the latency the engines then measure is
compared with what the model predicts for the load they had: the ratio (`correction`, smoothed)
scales every prediction, so a model that is right in shape but off in scale is put right in a
few intervals.

From the fit: one replica's capacity at the targets — how many decode streams it can run with
ITL <= the target and the KV cache it has, and how many prompt tokens per second it can prefill
with TTFT <= the target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional, Sequence

Matrix = tuple[tuple[float, ...], ...]

# Priors: a step's fixed part, per-request (decode) / per-token (prefill) part and context part,
# with the spread the fit starts from. Wide on purpose: what a replica does is learnt within a few
# intervals of traffic; until then, these err towards a slow engine (more replicas, not fewer).
DECODE_PRIOR = (0.02, 0.0005, 2e-8)
DECODE_PRIOR_SCALE = (0.05, 0.002, 1e-6)
PREFILL_PRIOR = (0.02, 1e-4, 1e-8)
PREFILL_PRIOR_SCALE = (0.05, 1e-3, 1e-6)
FORGET = 0.97  # per observation: old observations fade (an engine or a shape that changed)
MAX_WEIGHT = 50.0  # one interval's steps count at most this much (model error does not average out)
RELATIVE_NOISE = 0.1  # a mean step time is known to about this share...
ABSOLUTE_NOISE = 0.001  # ...plus this many seconds
CORRECTION_BOUNDS = (0.5, 4.0)
CORRECTION_SMOOTHING = 0.3  # weight of the newest measured/predicted ratio
DEFAULT_MAX_BATCHED_TOKENS = 8192  # a prefill step's size when the engine does not say
# The decode fit is trusted up to this many times the largest batch it has seen (and always up to
# TRUST_FLOOR requests): engines that ran at one batch size tell little of the slope beyond it,
# and a prior's slope is a guess. The capacity grows with what the load shows the engines can do.
# (Prefill needs no such bound: prompts of different lengths already vary every term.)
TRUST_FACTOR = 2.0
TRUST_FLOOR = 8.0


@dataclass(frozen=True)
class Fit:
    """Bayesian linear regression by recursive least squares: y ~ theta . x."""

    theta: tuple[float, ...]
    cov: Matrix
    prior_cov: Matrix
    weight: float = 0.0  # observations taken so far (weighted, before forgetting)

    @classmethod
    def prior(cls, theta: Sequence[float], scale: Sequence[float]) -> "Fit":
        cov = tuple(tuple((s * s if i == j else 0.0) for j, s in enumerate(scale)) for i, _ in enumerate(scale))
        return cls(tuple(float(t) for t in theta), cov, cov)

    def coefficients(self) -> tuple[float, ...]:
        """The coefficients used to predict: a negative one (noise early on) counts as zero."""
        return tuple(max(0.0, t) for t in self.theta)

    def predict(self, x: Sequence[float]) -> float:
        return sum(t * xi for t, xi in zip(self.coefficients(), x))

    def update(self, x: Sequence[float], y: float, weight: float = 1.0) -> "Fit":
        if not (math.isfinite(y) and y > 0 and weight > 0 and all(math.isfinite(v) for v in x)):
            return self
        n = len(self.theta)
        w = min(float(weight), MAX_WEIGHT)
        noise = (RELATIVE_NOISE * y + ABSOLUTE_NOISE) ** 2 / w
        p = [list(row) for row in self.cov]
        px = [sum(p[i][j] * x[j] for j in range(n)) for i in range(n)]
        denom = noise + sum(x[i] * px[i] for i in range(n))
        if denom <= 0:
            return self
        gain = [v / denom for v in px]
        err = y - sum(t * xi for t, xi in zip(self.theta, x))
        theta = tuple(self.theta[i] + gain[i] * err for i in range(n))
        new = [[(p[i][j] - gain[i] * px[j]) / FORGET for j in range(n)] for i in range(n)]
        # Forgetting inflates the spread of what the data does not excite; never past the prior's.
        for i in range(n):
            cap = self.prior_cov[i][i]
            if new[i][i] > cap:
                s = math.sqrt(cap / new[i][i])
                for j in range(n):
                    new[i][j] *= s
                    new[j][i] *= s
        cov = tuple(tuple(row) for row in new)
        return replace(self, theta=theta, cov=cov, weight=self.weight + w)

    def to_dict(self) -> dict[str, Any]:
        return {"theta": list(self.theta), "cov": [list(r) for r in self.cov], "weight": self.weight}


def decode_features(batch: float, context: float) -> tuple[float, float, float]:
    """batch: requests in the step; context: their mean context (tokens)."""
    return (1.0, batch, batch * context)


def prefill_features(tokens: float, token_context: float) -> tuple[float, float, float]:
    """tokens: computed in the step; token_context: sum over its requests of new tokens x context."""
    return (1.0, tokens, token_context)


def smoothed_ratio(previous: float, measured: Optional[float], predicted: Optional[float]) -> float:
    """The correction after one more measured/predicted pair (kept when either is unknown)."""
    if measured is None or predicted is None or measured <= 0 or predicted <= 0:
        return previous
    lo, hi = CORRECTION_BOUNDS
    ratio = min(hi, max(lo, measured / predicted))
    # Smoothed in log space: a ratio of 2 and one of 1/2 cancel.
    return math.exp((1 - CORRECTION_SMOOTHING) * math.log(previous) + CORRECTION_SMOOTHING * math.log(ratio))


@dataclass(frozen=True)
class RoleModel:
    """One role's model: the step-time fit and the correction of its predicted latency."""

    fit: Fit
    correction: float = 1.0

    @classmethod
    def decode(cls) -> "RoleModel":
        return cls(Fit.prior(DECODE_PRIOR, DECODE_PRIOR_SCALE))

    @classmethod
    def prefill(cls) -> "RoleModel":
        return cls(Fit.prior(PREFILL_PRIOR, PREFILL_PRIOR_SCALE))

    def to_dict(self) -> dict[str, Any]:
        return {"fit": self.fit.to_dict(), "correction": self.correction}


@dataclass(frozen=True)
class DecodeCapacity:
    batch: float  # streams one replica runs at the target
    tokens_per_s: float  # tokens it then generates per second
    bound: str  # what limits it: itl, kv, max_batch or seen (none: the target is out of reach)
    itl_s: float  # the ITL at that batch, as predicted

    def describe(self) -> str:
        return f"batch {self.batch:.1f} ({self.bound}-bound), {self.tokens_per_s:.0f} tok/s at ITL {self.itl_s:.3f}s"


def decode_capacity(
    model: RoleModel,
    itl_target_s: float,
    context: float,
    kv_tokens: Optional[float] = None,
    max_batch: Optional[float] = None,
    largest_seen: Optional[float] = None,
) -> DecodeCapacity:
    """One decode replica at the ITL target: the largest batch whose predicted step (with the
    correction) fits the target, bounded by the KV cache (kv_tokens of context in all), the
    engine's batch limit and TRUST_FACTOR x the largest batch the fit has seen."""
    a, b, c = model.fit.coefficients()
    k = model.correction
    context = max(1.0, context)
    per = b + c * context
    budget = itl_target_s / k - a
    if budget <= 0:
        return DecodeCapacity(0.0, 0.0, "none", k * a)
    batch, bound = (budget / per, "itl") if per > 0 else (math.inf, "itl")
    if kv_tokens is not None and kv_tokens > 0 and kv_tokens / context < batch:
        batch, bound = kv_tokens / context, "kv"
    if max_batch is not None and max_batch > 0 and max_batch < batch:
        batch, bound = float(max_batch), "max_batch"
    trusted = max(TRUST_FLOOR, TRUST_FACTOR * (largest_seen or 0.0))
    if largest_seen is not None and trusted < batch:
        batch, bound = trusted, "seen"
    if not math.isfinite(batch):
        batch = 1e6
    itl = k * (a + per * batch)
    return DecodeCapacity(batch, batch / itl if itl > 0 else 0.0, bound, itl)


@dataclass(frozen=True)
class PrefillCapacity:
    tokens_per_s: float  # prompt tokens one replica prefills per second with full steps
    service_s: float  # time to first token of one prompt on an idle replica, as predicted
    max_utilization: float  # the busiest a replica may be for the queueing to keep the TTFT p90 within the target

    def describe(self) -> str:
        return (
            f"{self.tokens_per_s:.0f} prompt tok/s, {self.service_s:.3f}s alone, "
            f"at most {self.max_utilization:.0%} busy for the TTFT target"
        )


def prefill_service_s(model: RoleModel, prompt_len: float, context: Optional[float] = None) -> float:
    """An idle replica's time to the first token of one prompt of prompt_len tokens (`context`:
    the mean context a prompt token is computed with, prompt_len by default)."""
    prompt_len = max(1.0, prompt_len)
    ctx = max(1.0, context or prompt_len)
    return model.correction * model.fit.predict(prefill_features(prompt_len, prompt_len * ctx))


# The TTFT target is for the 90th percentile of requests, not the mean: the wait of a busy queue
# has a tail close to an exponential's, whose 90th percentile is ln(10) times its mean.
TTFT_TAIL = math.log(10)


def queueing_ttft_s(service_s: float, utilization: float, tail: float = 1.0) -> float:
    """Time to first token of a replica this busy: its service time plus the wait of a queue with
    (nearly) constant service times (M/D/1), whose mean is service x rho / (2 (1 - rho)); `tail`
    scales the wait (1: the mean; TTFT_TAIL: about the 90th percentile)."""
    if utilization >= 1:
        return math.inf
    rho = max(0.0, utilization)
    return service_s * (1 + tail * rho / (2 * (1 - rho)))


def prefill_capacity(
    model: RoleModel,
    ttft_target_s: float,
    prompt_len: float,
    max_batched_tokens: Optional[float] = None,
    context: Optional[float] = None,
) -> PrefillCapacity:
    """One prefill replica at the TTFT target. `context`: the mean context a prompt token is
    computed with (sum of new x context over sum of new, from the step totals): with prompts of
    varied length it exceeds the mean prompt length (long prompts cost more than their share)."""
    tokens = float(max_batched_tokens or DEFAULT_MAX_BATCHED_TOKENS)
    prompt_len = max(1.0, prompt_len)
    ctx = max(1.0, context or prompt_len)
    # The throughput is the fitted step's: the correction compares measured TTFT with the queueing
    # model, so it scales the time to first token (and through it the utilization allowed), not
    # the step time the engines reported.
    step = model.fit.predict(prefill_features(tokens, tokens * min(ctx, tokens)))
    rate = tokens / step if step > 0 else 0.0
    service = prefill_service_s(model, prompt_len, ctx)
    r = ttft_target_s / service if service > 0 else math.inf
    if r <= 1:
        rho = 0.0
    elif math.isinf(r):
        rho = 1.0
    else:  # solve queueing_ttft_s(service, rho, TTFT_TAIL) = target for rho
        x = 2 * (r - 1) / TTFT_TAIL
        rho = x / (1 + x)
    return PrefillCapacity(rate, service, rho)


@dataclass(frozen=True)
class ModelState:
    """Both roles' models (the planner's state keeps it from round to round)."""

    decode: RoleModel = field(default_factory=RoleModel.decode)
    prefill: RoleModel = field(default_factory=RoleModel.prefill)

    def role(self, role: str) -> RoleModel:
        return self.prefill if role == "prefill" else self.decode

    def with_role(self, role: str, model: RoleModel) -> "ModelState":
        return replace(self, **{role: model})

    def to_dict(self) -> dict[str, Any]:
        return {"decode": self.decode.to_dict(), "prefill": self.prefill.to_dict()}


def steps_observation(
    totals: Mapping[str, float], role: str
) -> Optional[tuple[tuple[float, float, float], float, float]]:
    """(features of the mean step, mean step seconds, steps) from one interval's step-total deltas
    of one kind (decode for decode engines, prefill for prefill ones); None without steps."""
    steps = float(totals.get("steps") or 0)
    seconds = float(totals.get("seconds") or 0)
    if steps <= 0 or seconds <= 0:
        return None
    if role == "decode":
        batch = float(totals.get("requests") or 0) / steps
        if batch <= 0:
            return None
        context = float(totals.get("request_context") or 0) / steps / batch
        return decode_features(batch, context), seconds / steps, steps
    tokens = float(totals.get("tokens") or 0) / steps
    if tokens <= 0:
        return None
    return prefill_features(tokens, float(totals.get("token_context") or 0) / steps), seconds / steps, steps
