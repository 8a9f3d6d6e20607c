"""Remediation policy: verdicts + budget state -> ordered actions + the next budget state.

Pure: the caller passes the time, the pods it sees and the previous state, and gets back a new
state (the old one is never changed).  The state is JSON-serialisable so the operator can keep it
in an annotation: after an operator restart mid-remediation, ``decide`` re-emits only the steps
not yet recorded as done, and never starts a second remediation of a pod that has one open.

For each Wedged pod, in order: capture evidence -> drain -> abort -> restart.  Limits:

* per role, never more pods unavailable at once than ``max_unavailable[role]``; pods under
  remediation and pods not Ready both count (the wedged pod itself counts once);
* per pod, a cooldown after each finished remediation that doubles with every further one
  (``cooldown * 2**(n-1)``, capped), forgotten after a quiet period without wedges;
* a decode stuck waiting for KV is held (``prefill_first``) while a prefill's hand-off is stuck
  or under remediation: the prefill is the cause, and its aborts reach the decode;
* ``dry_run``: a Report per wedge episode and RemediationHeld when a limit blocks; nothing else;
* corroboration: an ``unresponsive`` pod (silent to the operator) is remediated only when the
  cluster agrees: the kubelet reports it not Ready (its probes fail) or its container restarts.
  A silent pod the kubelet reports Ready is held (``uncorroborated``): the operator's own scrape
  is the only evidence, and the operator's network is as likely at fault as the pod. When the
  caller judges the operator blind (most Ready pods went silent together, see
  ``watchdog.corroboration``), every ``unresponsive`` pod is held (``operator_blind``); a pod
  wedged on its own reachable metrics (stuck inflight, stalled loop) is still remediated;
* a global restart allowance (the operator-wide rate limit, ``corroboration.RestartRateLimit``):
  no more new remediations start in a round than the caller allows (``rate_limited``).

The executor runs a decision's step actions in order and records each with ``complete_step``.
Steps before the restart are best effort (a dead pod answers no /debug/stacks, yet must still be
restarted): recording them as failed still moves on.  A failed restart stays pending and is
emitted again on the next decision.  Restart actions carry the wedged pod's UID so the executor
can delete with a UID precondition: replaying a restart never deletes the pod's replacement.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple

from dsv4_wire import ANNOTATION_REMEDIATION_STATE

from .detector import Reason, Slow, Verdict, Wedged

STATE_ANNOTATION = ANNOTATION_REMEDIATION_STATE

CAPTURE_EVIDENCE = "capture_evidence"
DRAIN = "drain"
ABORT = "abort"
RESTART = "restart"
STEPS = (CAPTURE_EVIDENCE, DRAIN, ABORT, RESTART)
REPORT = "report"
HELD = "remediation_held"

HOLD_BUDGET = "budget"
HOLD_COOLDOWN = "cooldown"
HOLD_PREFILL_FIRST = "prefill_first"
HOLD_UNCORROBORATED = "uncorroborated"
HOLD_OPERATOR_BLIND = "operator_blind"
HOLD_RATE_LIMIT = "rate_limited"
UNRESPONSIVE = Reason.UNRESPONSIVE  # the detector's reason for a pod silent for a whole window


@dataclass(frozen=True)
class PodInfo:
    role: str
    ready: bool = True
    uid: str | None = None
    restarting: bool = False  # the kubelet restarts its container (CrashLoopBackOff, recent restart)
    draining: bool = False  # out of the routers (a scale-down's drain): Ready, but serves nothing new

    @property
    def cluster_sees_trouble(self) -> bool:
        """The kubelet's own probes agree something is wrong with the pod."""
        return not self.ready or self.restarting


@dataclass(frozen=True)
class RemediationSettings:
    enabled: bool = True
    dry_run: bool = False
    # Per role: an int, or a percentage string ("25%") of the role's pods, rounded up.
    max_unavailable: Mapping[str, int | str] = field(default_factory=lambda: {"prefill": 1, "decode": 1})
    default_max_unavailable: int | str = 1
    cooldown_s: float = 300.0
    max_backoff_s: float = 3600.0
    reset_after_s: float = 3600.0  # quiet time that forgets a pod's remediation count
    capture_evidence: bool = True
    # After the restart step: the record closes when the pod is Ready again as a new pod (new
    # UID), or, where UIDs are unknown (local processes), Ready and past restart_grace_s; it
    # closes anyway after recovery_timeout_s so one stuck restart cannot hold the budget forever.
    restart_grace_s: float = 10.0
    recovery_timeout_s: float = 600.0


@dataclass(frozen=True)
class Action:
    kind: str
    pod: str
    role: str
    reason: str
    uid: str | None = None
    attempt: int = 0
    dry_run: bool = False
    details: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["details"] = dict(self.details)
        return out


@dataclass(frozen=True)
class RemediationRecord:
    pod: str
    role: str
    reason: str
    started_at: float
    attempt: int
    uid: str | None = None
    steps_done: tuple[str, ...] = ()
    restarted_at: float | None = None
    notes: tuple[str, ...] = ()

    def remaining(self) -> tuple[str, ...]:
        return tuple(s for s in STEPS if s not in self.steps_done)


@dataclass(frozen=True)
class PodHistory:
    count: int
    last_finished_at: float
    last_wedged_at: float
    last_result: str = ""


def _frozen(d: Mapping) -> Mapping:
    return MappingProxyType(dict(d))


@dataclass(frozen=True)
class PolicyState:
    active: Mapping[str, RemediationRecord] = field(default_factory=lambda: _frozen({}))
    history: Mapping[str, PodHistory] = field(default_factory=lambda: _frozen({}))
    reported: frozenset[str] = frozenset()  # pods whose current wedge episode was reported
    held: Mapping[str, str] = field(default_factory=lambda: _frozen({}))  # pod -> hold reason

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "active": {k: asdict(v) for k, v in sorted(self.active.items())},
            "history": {k: asdict(v) for k, v in sorted(self.history.items())},
            "reported": sorted(self.reported),
            "held": dict(sorted(self.held.items())),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "PolicyState":
        if not data:
            return cls()
        active = {}
        for pod, rec in (data.get("active") or {}).items():
            rec = dict(rec)
            rec["steps_done"] = tuple(rec.get("steps_done") or ())
            rec["notes"] = tuple(rec.get("notes") or ())
            active[pod] = RemediationRecord(**rec)
        history = {pod: PodHistory(**h) for pod, h in (data.get("history") or {}).items()}
        return cls(
            active=_frozen(active),
            history=_frozen(history),
            reported=frozenset(data.get("reported") or ()),
            held=_frozen(data.get("held") or {}),
        )

    @classmethod
    def from_json(cls, text: str | None) -> "PolicyState":
        return cls.from_dict(json.loads(text) if text else None)


class Decision(NamedTuple):
    actions: list[Action]
    state: PolicyState


def backoff_seconds(count: int, settings: RemediationSettings) -> float:
    """Wait after the count-th remediation of a pod before the next may start."""
    if count <= 0:
        return 0.0
    return min(settings.cooldown_s * (2 ** (count - 1)), settings.max_backoff_s)


def resolve_max_unavailable(value: int | str, role_size: int) -> int:
    if isinstance(value, str):
        text = value.strip()
        if text.endswith("%"):
            return math.ceil(float(text[:-1]) * role_size / 100.0)
        value = int(text)
    return max(int(value), 0)


def _as_pod_info(value: PodInfo | str) -> PodInfo:
    return value if isinstance(value, PodInfo) else PodInfo(role=str(value))


def decide(
    verdicts: Mapping[str, Verdict],
    pods: Mapping[str, PodInfo | str],
    state: PolicyState,
    now: float,
    settings: RemediationSettings,
    *,
    blind: bool = False,
    restart_allowance: int | None = None,
) -> Decision:
    """One round of the policy.  ``pods``: every engine pod the watchdog sees (a bare role string
    stands for a Ready pod of that role).  ``blind``: the operator cannot trust its own view of
    reachability (most Ready pods went silent together): hold every ``unresponsive`` pod.
    ``restart_allowance``: how many new remediations may start this round (None: no limit)."""
    if not settings.enabled:
        return Decision([], state)
    info = {name: _as_pod_info(p) for name, p in pods.items()}
    wedged = {pod: v for pod, v in verdicts.items() if isinstance(v, Wedged)}
    active = dict(state.active)
    history = dict(state.history)
    actions: list[Action] = []

    # 1. Close remediations whose pod came back (or went away, or never recovered in time).
    closed: set[str] = set()
    for pod, rec in list(active.items()):
        result = _closing_result(rec, info.get(pod), now, settings)
        if result is None:
            continue
        del active[pod]
        closed.add(pod)
        prev = history.get(pod)
        history[pod] = PodHistory(
            count=(prev.count if prev else 0) + 1,
            last_finished_at=now,
            last_wedged_at=prev.last_wedged_at if prev else rec.started_at,
            last_result=result,
        )

    # 2. Remember wedges; forget the remediation count of pods quiet for long enough.
    for pod, hist in list(history.items()):
        if pod in wedged:
            history[pod] = replace(hist, last_wedged_at=now)
        elif now - max(hist.last_finished_at, hist.last_wedged_at) >= settings.reset_after_s:
            del history[pod]

    # 3. A wedge episode ends when the pod stops being Wedged or its remediation closes.
    reported = {p for p in state.reported if (p in wedged or p in active) and p not in closed}
    held = {p: r for p, r in state.held.items() if p in wedged}

    # 4. Who is unavailable now, per role.
    unavailable: dict[str, set[str]] = {}
    role_size: dict[str, int] = {}
    for pod, p in info.items():
        role_size[p.role] = role_size.get(p.role, 0) + 1
        # a pod the planner drains for a scale-down is out of service too: the budget is shared
        if not p.ready or p.draining or pod in active:
            unavailable.setdefault(p.role, set()).add(pod)
    for pod, rec in active.items():
        unavailable.setdefault(rec.role, set()).add(pod)

    # 5. Open remediations: emit what is left of them, in order.
    if not settings.dry_run:
        for pod in sorted(active):
            actions.extend(_step_actions(active[pod], settings))

    # 6. New wedges.
    prefill_trouble = sorted(
        p
        for p, v in verdicts.items()
        if p in info
        and info[p].role == "prefill"
        and (
            (isinstance(v, Wedged) and v.reason == Reason.STUCK_INFLIGHT)
            or (isinstance(v, Slow) and v.reason == Reason.HANDOFF_SLOW)
            or p in active
        )
    )
    for pod in sorted(wedged):
        if pod in active or pod not in info:
            continue
        verdict = wedged[pod]
        role = info[pod].role
        hold, hold_details = _corroboration_hold(verdict, info[pod], blind)
        if hold is None and pod not in reported:
            # A silence the cluster does not confirm is no wedge to report, only a hold.
            reported.add(pod)
            actions.append(
                Action(
                    REPORT,
                    pod,
                    role,
                    verdict.reason,
                    uid=info[pod].uid,
                    dry_run=settings.dry_run,
                    details=dict(verdict.details),
                )
            )
        if hold is None:
            hold, hold_details = _hold_reason(pod, role, history.get(pod), unavailable, role_size, now, settings)
        if hold is None and restart_allowance is not None and not settings.dry_run:
            if restart_allowance <= 0:
                hold, hold_details = HOLD_RATE_LIMIT, {}
            else:
                restart_allowance -= 1
        if hold is None and role == "decode" and verdict.reason == Reason.STUCK_TRANSFER and prefill_trouble:
            # A decode waiting for KV is the victim of a prefill whose hand-off is stuck; fixing
            # the prefill (whose aborts reach this decode) heals it, restarting it would not.
            hold, hold_details = HOLD_PREFILL_FIRST, {"prefill_pods": prefill_trouble}
        if hold is not None:
            if held.get(pod) != hold:
                held[pod] = hold
                actions.append(
                    Action(HELD, pod, role, hold, uid=info[pod].uid, dry_run=settings.dry_run, details=hold_details)
                )
            continue
        held.pop(pod, None)
        unavailable.setdefault(role, set()).add(pod)
        if settings.dry_run:
            continue  # counted against the budget of this round only: shows what would happen
        prev = history.get(pod)
        rec = RemediationRecord(
            pod=pod,
            role=role,
            reason=verdict.reason,
            started_at=now,
            attempt=(prev.count if prev else 0) + 1,
            uid=info[pod].uid,
            steps_done=() if settings.capture_evidence else (CAPTURE_EVIDENCE,),
        )
        active[pod] = rec
        actions.extend(_step_actions(rec, settings, details=dict(verdict.details)))

    new_state = PolicyState(
        active=_frozen(active), history=_frozen(history), reported=frozenset(reported), held=_frozen(held)
    )
    return Decision(actions, new_state)


def _closing_result(
    rec: RemediationRecord, pod: PodInfo | None, now: float, settings: RemediationSettings
) -> str | None:
    if rec.restarted_at is None:
        return "pod_gone" if pod is None else None
    if pod is None:  # deleted by our restart and not yet recreated: still unavailable
        return "recovery_timeout" if now - rec.restarted_at >= settings.recovery_timeout_s else None
    replaced = rec.uid is not None and pod.uid is not None and pod.uid != rec.uid
    if pod.ready and (
        replaced or ((rec.uid is None or pod.uid is None) and now - rec.restarted_at >= settings.restart_grace_s)
    ):
        return "restarted"
    if now - rec.restarted_at >= settings.recovery_timeout_s:
        return "recovery_timeout"
    return None


def _corroboration_hold(verdict: Wedged, pod: PodInfo, blind: bool) -> tuple[str | None, dict[str, Any]]:
    """Silence alone is the operator's evidence, not the cluster's: act on it only when the
    kubelet agrees, and never while the operator is blind."""
    if verdict.reason != UNRESPONSIVE:
        return None, {}  # wedged on its own metrics: the pod answered, the evidence is real
    if blind:
        return HOLD_OPERATOR_BLIND, {}
    if not pod.cluster_sees_trouble:
        return HOLD_UNCORROBORATED, {"kubelet_ready": pod.ready}
    return None, {}


def _hold_reason(
    pod: str,
    role: str,
    hist: PodHistory | None,
    unavailable: Mapping[str, set[str]],
    role_size: Mapping[str, int],
    now: float,
    settings: RemediationSettings,
) -> tuple[str | None, dict[str, Any]]:
    if hist is not None:
        wait = backoff_seconds(hist.count, settings)
        until = hist.last_finished_at + wait
        if now < until:
            return HOLD_COOLDOWN, {"until": until, "backoff_seconds": wait, "remediations": hist.count}
    limit = resolve_max_unavailable(
        settings.max_unavailable.get(role, settings.default_max_unavailable), role_size.get(role, 0)
    )
    others = sorted(unavailable.get(role, set()) - {pod})
    if len(others) + 1 > limit:
        return HOLD_BUDGET, {"max_unavailable": limit, "unavailable": others}
    return None, {}


def _step_actions(
    rec: RemediationRecord, settings: RemediationSettings, details: Mapping[str, Any] | None = None
) -> list[Action]:
    return [
        Action(step, rec.pod, rec.role, rec.reason, uid=rec.uid, attempt=rec.attempt, details=dict(details or {}))
        for step in rec.remaining()
    ]


def complete_step(
    state: PolicyState, pod: str, step: str, now: float, *, ok: bool = True, note: str | None = None
) -> PolicyState:
    """Record that the executor ran ``step`` for ``pod``.  Best-effort steps count as done even
    when they failed (with a note); a failed restart stays pending."""
    rec = state.active.get(pod)
    if rec is None or step not in STEPS or step in rec.steps_done:
        return state
    notes = rec.notes + ((f"{step}: {note}" if note else f"{step} failed",) if not ok or note else ())
    if step == RESTART and not ok:
        rec = replace(rec, notes=notes)
    else:
        rec = replace(
            rec,
            steps_done=rec.steps_done + (step,),
            notes=notes,
            restarted_at=now if step == RESTART else rec.restarted_at,
        )
    active = dict(state.active)
    active[pod] = rec
    return replace(state, active=_frozen(active))
