"""Pure: when the operator's own view of reachability can be trusted, and how fast it may restart.

The watchdog scrapes engines over the pod network; a pod it cannot reach may be dead, or the
operator may be cut off (a default-deny NetworkPolicy, a broken CNI on the operator's node, a
partitioned operator). The kubelet probes the same pods from their own node, so it is the second
witness:

* a silent pod the kubelet reports Ready is not restarted (the policy's ``uncorroborated`` hold);
* when most Ready pods of a deployment, or of every deployment this operator watches, went silent
  together, the fault is the operator's: it is *blind*, and holds every silence-based restart
  (``operator_blind``) until it sees again. One pod silent alone is not blindness.

``RestartRateLimit`` is the operator-wide brake on top of the per-role budgets: at most
``max_restarts`` new remediations in any ``per_seconds``, whatever the deployment.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping

from .detector import Unreachable, Verdict, Wedged
from .policy import UNRESPONSIVE, PodInfo

# Blind when more than this share of the Ready pods went silent, and at least MIN_SILENT of them.
BLIND_SHARE = 0.5
MIN_SILENT = 2
FLEET_REPORT_TTL_S = 120.0  # a deployment's last count older than this no longer speaks


@dataclass(frozen=True)
class Silence:
    """One round of one deployment: Ready pods (per the kubelet), and which of them the operator
    could not reach."""

    ready: int
    silent: tuple[str, ...]

    @property
    def blind(self) -> bool:
        return is_blind(len(self.silent), self.ready)


def is_silent(verdict: Verdict) -> bool:
    return isinstance(verdict, Unreachable) or (isinstance(verdict, Wedged) and verdict.reason == UNRESPONSIVE)


def observe_silence(verdicts: Mapping[str, Verdict], pods: Mapping[str, PodInfo]) -> Silence:
    ready = sorted(name for name, p in pods.items() if p.ready)
    silent = tuple(name for name in ready if name in verdicts and is_silent(verdicts[name]))
    return Silence(ready=len(ready), silent=silent)


def is_blind(silent: int, ready: int, share: float = BLIND_SHARE, min_silent: int = MIN_SILENT) -> bool:
    return silent >= min_silent and ready > 0 and silent > share * ready


@dataclass
class FleetSilence:
    """The latest Silence of every deployment one operator watches, so that one deployment's round
    can tell a partition of the operator (many deployments silent at once) from its own trouble.
    Kept in memory: shared by the deployments' watchdogs of one process."""

    ttl_s: float = FLEET_REPORT_TTL_S
    reports: dict[str, tuple[float, Silence]] = field(default_factory=dict)

    def report(self, deployment: str, silence: Silence, now: float) -> None:
        self.reports[deployment] = (now, silence)

    def forget(self, deployment: str) -> None:
        self.reports.pop(deployment, None)

    def blind(self, now: float) -> bool:
        live = [s for t, s in self.reports.values() if now - t <= self.ttl_s]
        return is_blind(sum(len(s.silent) for s in live), sum(s.ready for s in live))

    def judge(self, deployment: str, silence: Silence, now: float) -> bool:
        """Record this deployment's round and say whether the operator is blind for it."""
        self.report(deployment, silence, now)
        return silence.blind or self.blind(now)


@dataclass
class RestartRateLimit:
    """At most ``max_restarts`` remediation starts in any ``per_seconds`` window, per operator."""

    max_restarts: int = 10
    per_seconds: float = 600.0
    starts: deque = field(default_factory=deque)

    def _expire(self, now: float) -> None:
        while self.starts and now - self.starts[0] >= self.per_seconds:
            self.starts.popleft()

    def allowance(self, now: float) -> int:
        self._expire(now)
        return max(self.max_restarts - len(self.starts), 0)

    def record(self, now: float, count: int = 1) -> None:
        self._expire(now)
        self.starts.extend([now] * count)

    @classmethod
    def parse(cls, text: str | None) -> "RestartRateLimit":
        """``"10/600"``: ten restarts per 600 seconds (the DSV4_RESTART_RATE_LIMIT form)."""
        if not text:
            return cls()
        count, _, seconds = text.partition("/")
        limit = cls(max_restarts=int(count), per_seconds=float(seconds or 600.0))
        if limit.max_restarts < 0 or limit.per_seconds <= 0:
            raise ValueError(f"bad restart rate limit {text!r}: want COUNT/SECONDS")
        return limit


@dataclass
class Fleet:
    """What the watchdogs of one operator share: the silence of every deployment, the restart
    rate limit, and whether this replica may act at all (it holds the leader Lease)."""

    silence: FleetSilence = field(default_factory=FleetSilence)
    restarts: RestartRateLimit = field(default_factory=RestartRateLimit)
    may_act: Callable[[], bool] = lambda: True
