"""Wedge detector: a sliding window of samples per pod -> Healthy / Slow / Wedged / Unreachable.

Pure: no clock and no I/O; time is the samples' timestamps.

The rule it encodes (docs/design.md, "Defaults worth knowing"): slow is not wedged.  A pod is Wedged
only when, for the whole detection window,

* ``stuck_inflight`` (prefill): requests sit in the inflight queue (KV being sent to decode) and
  the hand-off does not move: no transfer completes, no transfer bytes flow, and the oldest
  inflight request does not change (its age keeps growing and has reached the window);
* ``stuck_transfer`` (decode): requests wait in the transfer queue for KV, no transfer completes
  and the decode produces no token at all;
* ``scheduler_stalled``: the engine has work (running or queued) but its scheduler loop does not
  iterate and no token moves (only where the engine exports a loop counter: SGLang's gauges are
  stale when idle, so they cannot prove a stall);
* ``unresponsive``: a pod that answered before has answered nothing for the window;
* ``rank_stalled`` (a worker node of a multi-node engine): one of its ranks has not beaten its
  heartbeat for the window (a rank frozen: the whole engine's collectives wait on it);
* ``clients_waiting_idle``, ``pd_not_exchanging``, ``router_stalled``: the hangs nobody else
  sees (hangs.py);

or, over the window, ``transfer_failures``: failed + timed-out transfers exceed the threshold share
of all finished transfers, with at least ``min_failed_transfers`` failures.

Compute progress (tokens, loop iterations) never clears a stuck hand-off on prefill: a prefill that
keeps computing while no transfer finishes is exactly the incident.  A long prefill has nothing
inflight, and a slow transfer moves bytes or completes, so neither is Wedged.

A restarted engine (any counter lower than before) starts a fresh window.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Mapping, Union

from . import hangs
from .signals import BUILTIN, COUNTER_FIELDS, EngineSample


class Reason(StrEnum):
    """Why a pod is Slow or Wedged: one name per cause, compared by the policy and the reports
    (a StrEnum: it prints, serialises and labels metrics as its plain value)."""

    UNRESPONSIVE = "unresponsive"  # silent for a whole window after it had answered
    TRANSFER_FAILURES = "transfer_failures"  # most KV transfers failing
    STUCK_INFLIGHT = "stuck_inflight"  # prefill: a hand-off pending and not moving (the incident)
    STUCK_TRANSFER = "stuck_transfer"  # decode: likewise, waiting for KV
    HANDOFF_SLOW = "handoff_slow"
    SCHEDULER_STALLED = "scheduler_stalled"  # work queued, the loop not turning
    RANK_STALLED = "rank_stalled"  # a worker node's rank frozen (its heartbeat stopped)
    SCHEDULER_SLOW = "scheduler_slow"
    CLIENTS_WAITING_IDLE = hangs.CLIENTS_WAITING_IDLE  # HTTP side holds requests the idle core never got
    PD_NOT_EXCHANGING = hangs.PD_NOT_EXCHANGING  # requests arrive, no KV moves with the peer role
    ROUTER_STALLED = hangs.ROUTER_STALLED  # requests wait in the router, none sent to engines


@dataclass(frozen=True)
class Healthy:
    state: ClassVar[str] = "Healthy"


@dataclass(frozen=True)
class Slow:
    """Work is waiting longer than usual but still within the window (or still moving)."""

    reason: str
    details: Mapping[str, Any] = field(default_factory=dict)
    state: ClassVar[str] = "Slow"


@dataclass(frozen=True)
class Wedged:
    reason: str
    details: Mapping[str, Any] = field(default_factory=dict)
    state: ClassVar[str] = "Wedged"


@dataclass(frozen=True)
class Unreachable:
    since: float
    error: str | None = None
    state: ClassVar[str] = "Unreachable"


Verdict = Union[Healthy, Slow, Wedged, Unreachable]


def verdict_to_dict(verdict: Verdict) -> dict[str, Any]:
    out: dict[str, Any] = {"state": verdict.state}
    for name in ("reason", "details", "since", "error"):
        if hasattr(verdict, name):
            value = getattr(verdict, name)
            out[name] = dict(value) if name == "details" else value
    return out


def _counter_delta(prev: float | None, cur: float | None) -> float:
    """Increase of a counter between two samples of one incarnation (0 when unknown)."""
    if prev is None or cur is None:
        return 0.0
    return max(cur - prev, 0.0)


def _restarted(prev: EngineSample, cur: EngineSample) -> bool:
    for name in COUNTER_FIELDS:
        a, b = getattr(prev, name), getattr(cur, name)
        if a is not None and b is not None and b < a:
            return True
    return False


def _positive(value: float | None) -> bool:
    return value is not None and value > 0


def _handoff_pending(s: EngineSample) -> float | None:
    """Requests whose KV hand-off is in progress on this pod, or None when not exported."""
    if s.role == "prefill":
        return s.prefill_inflight
    if s.role == "decode":
        return s.decode_transfer
    return None


# What tells that a hand-off moved, best first. Not every engine build exposes each: SGLang
# releases whose kv_transfer_latency_ms is a gauge (newer ones make it a histogram, whose _count
# is the completion counter) leave transfers_completed unknown. A prefill then falls back on its
# finished-requests counter, which every build exposes: a PD request finishes on prefill only
# once its KV left (or failed, which the failure counters see).
PROGRESS_SIGNALS = (
    "transfers_completed",
    "transfer_bytes",
    "prefill_inflight_oldest_age_seconds",
    "requests_completed",
)


def progress_signals(s: EngineSample) -> tuple[str, ...]:
    """Pure: the hand-off progress signals this sample reports (see PROGRESS_SIGNALS); what a
    verdict was judged by, named in its details and so in status and Events."""
    found = [name for name in PROGRESS_SIGNALS[:2] if getattr(s, name) is not None]
    if s.role == "prefill" and s.prefill_inflight_oldest_age_seconds is not None:
        found.append("prefill_inflight_oldest_age_seconds")
    if _requests_stand_in(s):
        found.append("requests_completed")
    return tuple(found)


def _requests_stand_in(s: EngineSample) -> bool:
    """Finished requests stand in for completed transfers on a prefill without the counter, but
    only when its inflight count is live: from SGLang's stale gauge alone, an idle prefill whose
    last request left after the last logged batch would read as one stuck forever."""
    return (
        s.role == "prefill"
        and s.transfers_completed is None
        and s.requests_completed is not None
        and (s.kind == BUILTIN or s.live_queues)
    )


def _completions(s: EngineSample) -> float | None:
    """Completed hand-offs: the transfer counter, else (prefill) the finished requests."""
    return s.requests_completed if _requests_stand_in(s) else s.transfers_completed


def _handoff_moved(prev: EngineSample, cur: EngineSample) -> bool:
    if _counter_delta(_completions(prev), _completions(cur)) > 0:
        return True
    if _counter_delta(prev.transfer_bytes, cur.transfer_bytes) > 0:
        return True
    if cur.role == "prefill":
        a, b = prev.prefill_inflight_oldest_age_seconds, cur.prefill_inflight_oldest_age_seconds
        # The oldest request left the queue: its successor is younger.
        if a is not None and b is not None and b < a:
            return True
    if cur.role == "decode":
        # A decode that still emits tokens is serving; its own KV-wait deadline handles one
        # straggler.  Only a decode that does nothing at all while KV waits is wedged.
        if _counter_delta(prev.generation_tokens, cur.generation_tokens) > 0:
            return True
    return False


def _compute_moved(prev: EngineSample, cur: EngineSample) -> bool:
    return (
        _counter_delta(prev.loop_iterations, cur.loop_iterations) > 0
        or _counter_delta(prev.generation_tokens, cur.generation_tokens) > 0
        or _counter_delta(prev.prompt_tokens, cur.prompt_tokens) > 0
    )


def _has_work(s: EngineSample) -> bool:
    return _positive(s.num_running) or _positive(s.num_queue)


@dataclass
class _PodWindow:
    samples: deque = field(default_factory=deque)  # reachable samples of the current incarnation
    ever_reachable: bool = False
    last_reachable_ts: float | None = None
    unreachable_since: float | None = None
    last_error: str | None = None


class Detector:
    """Keeps a window per pod; ``observe`` one sample at a time, in timestamp order per pod."""

    def __init__(
        self,
        window_s: float = 120.0,
        failure_rate_threshold: float = 0.5,
        *,
        min_failed_transfers: int = 3,
        slow_after_s: float | None = None,
    ) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        if not 0.0 <= failure_rate_threshold <= 1.0:
            raise ValueError("failure_rate_threshold must be within [0, 1]")
        self.window_s = float(window_s)
        self.failure_rate_threshold = float(failure_rate_threshold)
        self.min_failed_transfers = max(int(min_failed_transfers), 1)
        self.slow_after_s = float(slow_after_s) if slow_after_s is not None else self.window_s / 4
        self._pods: dict[str, _PodWindow] = {}

    # -- bookkeeping -----------------------------------------------------------------------------

    def forget(self, pod_key: str) -> None:
        """Drop a pod's history (it was deleted or replaced)."""
        self._pods.pop(pod_key, None)

    def pods(self) -> list[str]:
        return list(self._pods)

    def _prune(self, samples: deque, now: float) -> None:
        # Keep exactly one sample at or before the window's start: it anchors "for the whole
        # window" (the window is covered when samples[0] is at least window_s old).
        horizon = now - self.window_s
        while len(samples) >= 2 and samples[1].timestamp <= horizon:
            samples.popleft()

    # -- the verdict -----------------------------------------------------------------------------

    def observe(self, pod_key: str, sample: EngineSample, *, answered_before: bool = False) -> Verdict:
        """``answered_before``: the caller knows the engine served before this detector saw
        it (e.g. its pod was Ready, or the operator restarted), so a silence from the start may
        still end in ``unresponsive``; a pod never known to answer is only Unreachable."""
        pod = self._pods.setdefault(pod_key, _PodWindow())
        pod.ever_reachable = pod.ever_reachable or answered_before
        now = sample.timestamp
        if not sample.reachable:
            if pod.unreachable_since is None:
                pod.unreachable_since = now
            pod.last_error = sample.error
            silent_for = now - (pod.last_reachable_ts if pod.last_reachable_ts is not None else pod.unreachable_since)
            if pod.ever_reachable and silent_for >= self.window_s:
                return Wedged(
                    Reason.UNRESPONSIVE,
                    {
                        "silent_seconds": round(silent_for, 3),
                        "window_seconds": self.window_s,
                        "last_error": sample.error,
                    },
                )
            return Unreachable(pod.unreachable_since, sample.error)

        pod.ever_reachable = True
        pod.last_reachable_ts = max(now, pod.last_reachable_ts or now)
        pod.unreachable_since = None
        samples = pod.samples
        if samples and now <= samples[-1].timestamp:
            return self._judge(samples)  # late or duplicate sample: the window already has newer
        if samples and _restarted(samples[-1], sample):
            samples.clear()  # a restarted engine: what came before says nothing about it now
        samples.append(sample)
        self._prune(samples, now)
        return self._judge(samples)

    def _judge(self, samples: deque) -> Verdict:
        seq = list(samples)
        latest: EngineSample = seq[-1]
        covered = latest.timestamp - seq[0].timestamp >= self.window_s

        failures = self._failure_verdict(seq)
        if isinstance(failures, Wedged):
            return failures

        handoff = self._handoff_verdict(seq, covered)
        if isinstance(handoff, Wedged):
            return handoff

        stall = self._stall_verdict(seq)
        if isinstance(stall, Wedged):
            return stall

        for found in (
            hangs.clients_waiting_idle(seq, self.window_s),
            hangs.pd_not_exchanging(seq, self.window_s, covered),
            hangs.router_stalled(seq, self.window_s),
        ):
            if found is not None:
                return Wedged(Reason(found[0]), found[1])

        age = latest.rank_beat_age_seconds
        if age is not None and age >= self.window_s:
            return Wedged(Reason.RANK_STALLED, {"rank_beat_age_seconds": age, "window_seconds": self.window_s})

        for maybe in (handoff, stall, failures):
            if maybe is not None:
                return maybe
        return Healthy()

    @staticmethod
    def _increase(seq: list, name: str) -> float:
        # Counters only grow within one incarnation (a reset clears the window), so the increase
        # over the window is last - first among the samples that report the counter.
        first = next((v for v in (getattr(s, name) for s in seq) if v is not None), None)
        if first is None:
            return 0.0
        last = next(v for v in (getattr(s, name) for s in reversed(seq)) if v is not None)
        return max(last - first, 0.0)

    def _failure_verdict(self, seq: list) -> Verdict | None:
        failed = self._increase(seq, "transfer_failed") + self._increase(seq, "transfer_timeout")
        if failed <= 0:
            return None
        completed = self._increase(seq, "transfers_completed")
        if _requests_stand_in(seq[-1]):
            completed = self._increase(seq, "requests_completed")  # builds without the counter
        rate = failed / (failed + completed)
        if rate <= self.failure_rate_threshold:
            return None
        details = {
            "failed_transfers": failed,
            "completed_transfers": completed,
            "failure_rate": round(rate, 4),
            "threshold": self.failure_rate_threshold,
            "window_seconds": self.window_s,
        }
        if failed >= self.min_failed_transfers:
            return Wedged(Reason.TRANSFER_FAILURES, details)
        return Slow(Reason.TRANSFER_FAILURES, details)

    def _handoff_verdict(self, seq: list, covered: bool) -> Verdict | None:
        latest: EngineSample = seq[-1]
        if not _positive(_handoff_pending(latest)):
            return None
        # Walk back while the hand-off stayed pending and did not move.
        start = latest.timestamp
        for i in range(len(seq) - 1, 0, -1):
            prev, cur = seq[i - 1], seq[i]
            if not _positive(_handoff_pending(prev)) or _handoff_moved(prev, cur):
                break
            start = prev.timestamp
        stuck_for = latest.timestamp - start
        age = latest.prefill_inflight_oldest_age_seconds if latest.role == "prefill" else None
        signals = progress_signals(latest)
        has_progress_signal = bool(signals)
        details = {
            "role": latest.role,
            "pending": _handoff_pending(latest),
            "stuck_seconds": round(stuck_for, 3),
            "window_seconds": self.window_s,
            "oldest_inflight_age_seconds": age,
            "transfers_completed": latest.transfers_completed,
            "progress_signals": list(signals),
        }
        if covered and stuck_for >= self.window_s and has_progress_signal and (age is None or age >= self.window_s):
            reason = Reason.STUCK_INFLIGHT if latest.role == "prefill" else Reason.STUCK_TRANSFER
            return Wedged(reason, details)
        if stuck_for >= self.slow_after_s or (age is not None and age >= self.slow_after_s):
            return Slow(Reason.HANDOFF_SLOW, details)
        return None

    def _stall_verdict(self, seq: list) -> Verdict | None:
        latest: EngineSample = seq[-1]
        if latest.loop_iterations is None or not _has_work(latest):
            return None
        start = latest.timestamp
        for i in range(len(seq) - 1, 0, -1):
            prev, cur = seq[i - 1], seq[i]
            if not _has_work(prev) or prev.loop_iterations is None or _compute_moved(prev, cur):
                break
            start = prev.timestamp
        stalled_for = latest.timestamp - start
        details = {
            "stalled_seconds": round(stalled_for, 3),
            "window_seconds": self.window_s,
            "num_running": latest.num_running,
            "num_queue": latest.num_queue,
            "loop_iterations": latest.loop_iterations,
        }
        if stalled_for >= self.window_s:
            return Wedged(Reason.SCHEDULER_STALLED, details)
        if stalled_for >= self.slow_after_s:
            return Slow(Reason.SCHEDULER_SLOW, details)
        return None
