"""Pure: what a watchdog round means for the DSV4Deployment's status and Events.

The watchdog owns the Wedged condition and the fields `wedgedPods`, `lastRemediation`,
`remediationsTotal` and `stableRevision`; `dsv4_operator.status` carries them over when the
reconciler rewrites the rest. Messages hold nothing that moves every round (no ages, no
counters), so a status write happens when something changed, not on every scrape.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Mapping, Optional, Sequence

from dsv4_operator.watchdog.detector import Slow, Unreachable, Verdict, Wedged
from dsv4_operator.watchdog.policy import (
    ABORT,
    CAPTURE_EVIDENCE,
    DRAIN,
    HOLD_BUDGET,
    HOLD_COOLDOWN,
    HOLD_OPERATOR_BLIND,
    HOLD_PREFILL_FIRST,
    HOLD_RATE_LIMIT,
    HOLD_UNCORROBORATED,
    REPORT,
    RESTART,
    Action,
    RemediationRecord,
)

WEDGED = "Wedged"
OPERATOR_BLIND = "OperatorBlind"  # the Wedged condition's reason (status Unknown) while blind
SILENCE_HOLDS = (HOLD_UNCORROBORATED, HOLD_OPERATOR_BLIND)
STEP_ACTIONS = (CAPTURE_EVIDENCE, DRAIN, ABORT, RESTART)


def iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _condition(status: str, reason: str, message: str) -> dict[str, Any]:
    return {"type": WEDGED, "status": status, "reason": reason, "message": message}


def blind_message(silent: Sequence[str], ready: int) -> str:
    shown = ", ".join(sorted(silent)[:5]) + (", ..." if len(silent) > 5 else "")
    return (
        f"the operator cannot reach {len(silent)} of {ready} engine pods the kubelet reports Ready "
        f"({shown}): the operator's own network is the likely fault (NetworkPolicy, CNI, partition), "
        f"so no silent pod is restarted until it sees them again"
    )


def wedged_condition(
    *,
    enabled: bool,
    pods: int,
    verdicts: Mapping[str, Verdict],
    active: Mapping[str, RemediationRecord],
    dry_run: bool,
    suspect: Optional[str] = None,
    rollback: Optional[str] = None,
    held: Mapping[str, str] | None = None,
    blind: Optional[str] = None,
) -> dict[str, Any]:
    """The Wedged condition after a round. ``suspect``: the spec change the wedges follow, in
    words; ``rollback``: what was done or is suggested about it; ``held``: the policy's holds
    (pods held for silence alone are not called wedged); ``blind``: why the operator judged
    itself blind (then the condition is Unknown: the operator cannot tell)."""
    if not enabled:
        return _condition("Unknown", "WatchdogDisabled", "spec.remediation.enabled is false")
    if pods == 0:
        return _condition("Unknown", "NoEnginePods", "no prefill or decode pods to watch")
    unconfirmed = {p for p, r in (held or {}).items() if r in SILENCE_HOLDS}
    wedged = {p: v for p, v in verdicts.items() if isinstance(v, Wedged) and p not in unconfirmed}
    troubled = sorted(set(wedged) | set(active))
    if not troubled:
        if blind:
            return _condition("Unknown", OPERATOR_BLIND, blind)
        slow = sum(isinstance(v, Slow) for v in verdicts.values())
        unreachable = sum(isinstance(v, Unreachable) for v in verdicts.values()) + len(unconfirmed)
        extra = "".join(f", {n} {what}" for n, what in ((slow, "slow"), (unreachable, "not answering")) if n)
        if unconfirmed:
            extra += f" ({', '.join(sorted(unconfirmed))} Ready per the kubelet: not restarted on silence alone)"
        return _condition("False", "NoWedge", f"{pods} engine pods watched, none wedged{extra}")
    parts = []
    for pod in troubled:
        if pod in wedged:
            parts.append(f"{pod} ({wedged[pod].reason})")
        else:
            rec = active[pod]
            parts.append(f"{pod} ({rec.reason}, remediation {'restarted' if rec.restarted_at else 'in progress'})")
    message = f"{len(troubled)} wedged: {', '.join(parts)}"
    if dry_run:
        message += "; dry run: nothing was done"
    if suspect:
        message += f"; {suspect}"
    if rollback:
        message += f"; {rollback}"
    if blind:
        message += f"; {blind}"
    return _condition("True", "WedgedAfterSpecChange" if suspect else "WedgeDetected", message)


def wedged_pod_count(
    verdicts: Mapping[str, Verdict], active: Iterable[str], held: Mapping[str, str] | None = None
) -> int:
    unconfirmed = {p for p, r in (held or {}).items() if r in SILENCE_HOLDS}
    return len({p for p, v in verdicts.items() if isinstance(v, Wedged) and p not in unconfirmed} | set(active))


def remediation_record(
    action: Action, ok: bool, note: Optional[str], now: float, evidence: Optional[str] = None
) -> dict[str, Any]:
    """status.lastRemediation for one step (or, in dry run, one report)."""
    record: dict[str, Any] = {
        "time": iso(now),
        "pod": action.pod,
        "role": action.role,
        "action": action.kind,
        "reason": action.reason,
        "dryRun": action.dry_run,
        "result": "ok" if ok else "failed",
    }
    if action.attempt:
        record["attempt"] = action.attempt
    if note:
        record["note"] = note
    if evidence and action.kind == CAPTURE_EVIDENCE:
        record["evidence"] = evidence
    return record


def round_records(
    results: Sequence[tuple[Action, bool, Optional[str]]], now: float, evidence: Mapping[str, str]
) -> tuple[Optional[dict[str, Any]], int]:
    """(the round's last remediation record or None, restarts that deleted a pod). A restart
    whose pod was already gone or replaced (a replay after an operator restart) is not counted."""
    last, restarts = None, 0
    for action, ok, note in results:
        if action.kind in STEP_ACTIONS or (action.kind == REPORT and action.dry_run):
            last = remediation_record(action, ok, note, now, evidence.get(action.pod))
        if action.kind == RESTART and ok and not note:
            restarts += 1
    return last, restarts


def merged_status(
    previous: Mapping[str, Any], condition: Mapping[str, Any], fields: Mapping[str, Any], now: str
) -> dict[str, Any]:
    """The status keys the watchdog writes: every condition (a merge patch replaces the list),
    with Wedged replaced — its lastTransitionTime moves only when its status flips — plus
    ``fields``."""
    conditions = [dict(c) for c in previous.get("conditions") or []]
    new = dict(condition)
    old = next((c for c in conditions if c.get("type") == WEDGED), None)
    if old is not None and old.get("status") == new["status"] and old.get("lastTransitionTime"):
        new["lastTransitionTime"] = old["lastTransitionTime"]
    else:
        new["lastTransitionTime"] = now
    if old is None:
        conditions.append(new)
    else:
        conditions[conditions.index(old)] = new
    return {"conditions": conditions, **fields}


def hold_message(action: Action) -> str:
    d = action.details
    if action.reason == HOLD_BUDGET:
        others = ", ".join(d.get("unavailable") or []) or "none"
        return (
            f"{action.pod} ({action.role}) not remediated: maxUnavailable.{action.role} is "
            f"{d.get('max_unavailable')} and these are unavailable: {others}"
        )
    if action.reason == HOLD_COOLDOWN:
        until = d.get("until")
        return (
            f"{action.pod} ({action.role}) not remediated: cooldown after {d.get('remediations')} "
            f"remediation(s), until {iso(until) if isinstance(until, (int, float)) else until}"
        )
    if action.reason == HOLD_UNCORROBORATED:
        return (
            f"{action.pod} ({action.role}) not restarted: the operator cannot reach it, but the kubelet "
            f"reports it Ready and its container is not restarting; silence seen only by the operator is "
            f"no proof (check NetworkPolicies and the operator's node)"
        )
    if action.reason == HOLD_OPERATOR_BLIND:
        return (
            f"{action.pod} ({action.role}) not restarted: most engine pods went silent together, which "
            f"points at the operator's own network, not at the pods"
        )
    if action.reason == HOLD_RATE_LIMIT:
        return (
            f"{action.pod} ({action.role}) not remediated yet: the operator-wide restart rate limit is "
            f"spent; it is retried when the limit allows"
        )
    if action.reason == HOLD_PREFILL_FIRST:
        return (
            f"{action.pod} ({action.role}) not remediated: it waits for KV from stuck prefill pods "
            f"({', '.join(d.get('prefill_pods') or [])}), which are remediated first"
        )
    return f"{action.pod} ({action.role}) not remediated: {action.reason}"


def wedge_message(action: Action) -> str:
    d = action.details
    shown = []
    for key in (
        "pending",
        "stuck_seconds",
        "oldest_inflight_age_seconds",
        "failure_rate",
        "silent_seconds",
        "stalled_seconds",
        "window_seconds",
    ):
        if d.get(key) is not None:
            shown.append(f"{key}={d[key]}")
    text = f"{action.pod} ({action.role}) wedged: {action.reason}"
    if shown:
        text += f" ({', '.join(shown)})"
    if d.get("progress_signals"):  # what the engine exposes differs by build: say what was read
        text += f"; progress judged by {', '.join(d['progress_signals'])}"
    if action.dry_run:
        text += "; dry run: no action taken"
    return text
