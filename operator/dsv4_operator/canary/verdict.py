"""Keep or revert a canary: its probe figures against the stable revision's (the same probe on
an old engine) and what the watchdog saw. Pure; every failed check is one reason, in words."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class ProbeFigures:
    """What one probe measured on one engine."""

    requests: int = 0  # answered or failed
    errors: int = 0  # answered with an error (HTTP status or an error event in the stream)
    stalled: int = 0  # still without an answer after the probe's request timeout
    ttft_p99_s: Optional[float] = None
    itl_p99_s: Optional[float] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # streamed chunks that carried text (a chunk may hold more than one token)
    max_context: int = 0  # the longest prompt that got its whole answer
    context_target: int = 0  # the longest prompt the probe meant to send
    duration_s: float = 0.0
    first_error: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class WatchdogSignals:
    """What the watchdog read on the canary while the probe ran."""

    wedged: Optional[str] = None  # the wedge detector's reason, if it called the engine wedged
    kv_pages_free_before: Optional[float] = None  # idle, before the probe
    kv_pages_free_after: Optional[float] = None  # idle again after it (pages all back?)
    kv_pages_total: Optional[float] = None


@dataclass(frozen=True)
class CanaryThresholds:
    max_ttft_ratio: float = 2.0  # canary TTFT p99 <= ratio x stable's + slack
    max_itl_ratio: float = 2.0
    latency_slack_s: float = 0.05  # absolute allowance: ratios of milliseconds are noise
    # The canary must carry the conversation about as far as stable did. Loose: rounds are
    # discrete and a just-restarted engine on a busy machine may finish one round fewer in the
    # same time (slowness is the latency ratios' to judge; a stall also counts as stalled).
    min_context_ratio: float = 0.5
    max_leaked_pages: float = 0.0  # KV pages not given back once idle again


@dataclass(frozen=True)
class CanaryVerdict:
    passed: bool
    reasons: tuple[str, ...] = ()
    canary: dict[str, Any] = field(default_factory=dict)
    stable: Optional[dict[str, Any]] = None

    def summary(self) -> str:
        return "passed" if self.passed else "; ".join(self.reasons)

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "reasons": list(self.reasons), "canary": self.canary, "stable": self.stable}


def _ratio_reason(
    name: str, canary: Optional[float], stable: Optional[float], ratio: float, slack: float
) -> Optional[str]:
    if canary is None or stable is None:
        return None
    limit = stable * ratio + slack
    if canary > limit:
        return f"{name} p99 {canary * 1000:.0f} ms > {ratio:g} x stable {stable * 1000:.0f} ms + {slack * 1000:.0f} ms"
    return None


def judge(
    canary: ProbeFigures,
    stable: Optional[ProbeFigures],
    signals: WatchdogSignals,
    t: CanaryThresholds = CanaryThresholds(),
) -> CanaryVerdict:
    """Pass only if the canary answered every probe request without error or stall, was never
    called wedged, gave every KV page back, carried the conversation as far as the stable
    revision did, and kept TTFT/ITL p99 within the ratios of the stable revision's."""
    reasons: list[str] = []
    if signals.wedged:
        reasons.append(f"watchdog: wedged ({signals.wedged})")
    if canary.stalled:
        reasons.append(f"{canary.stalled} probe request(s) got no answer within the request timeout")
    if canary.errors:
        reasons.append(
            f"{canary.errors} probe request(s) failed" + (f": {canary.first_error}" if canary.first_error else "")
        )
    if canary.requests == 0:
        reasons.append("the probe completed no request")
    before, after = signals.kv_pages_free_before, signals.kv_pages_free_after
    if before is not None and after is not None and before - after > t.max_leaked_pages:
        reasons.append(f"memory: {before - after:g} KV page(s) not given back after the probe")
    reach = stable.max_context if stable is not None else canary.context_target
    if reach and canary.max_context < t.min_context_ratio * reach:
        reasons.append(
            f"the conversation reached {canary.max_context} tokens of context on the canary, "
            f"{reach} on {'the stable revision' if stable is not None else 'the target'}"
        )
    if stable is not None:
        for name, c, s, r in (
            ("TTFT", canary.ttft_p99_s, stable.ttft_p99_s, t.max_ttft_ratio),
            ("ITL", canary.itl_p99_s, stable.itl_p99_s, t.max_itl_ratio),
        ):
            why = _ratio_reason(name, c, s, r, t.latency_slack_s)
            if why:
                reasons.append(why)
    return CanaryVerdict(
        not reasons, tuple(reasons), canary.to_dict(), stable.to_dict() if stable is not None else None
    )
