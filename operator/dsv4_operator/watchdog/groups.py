"""Pure: a multi-node engine (a group of pods) is one worker to the watchdog.

Every pod of a group is scraped (the leader's engine metrics, each worker's node agent), each
with its own detection window; then their verdicts fold into one, the group's, under the
leader's name: the policy decides for the group once (one budget slot, one backoff, one
remediation), the executor captures evidence from every pod of it and restarts the group by its
leader (deleting the leader takes the workers with it; LWS or the operator makes the group anew).
A wedge in any rank — the leader's loop stalled waiting on a collective, a worker's rank that
stopped beating, a worker silent — is the group's wedge.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from .detector import Healthy, Slow, Unreachable, Verdict, Wedged
from .policy import PodInfo

_RANK = {Wedged: 3, Unreachable: 2, Slow: 1, Healthy: 0}


def _rank(v: Verdict) -> int:
    return _RANK.get(type(v), 0)


def fold_verdicts(verdicts: Mapping[str, Verdict], groups: Mapping[str, str]) -> dict[str, Verdict]:
    """Per-pod verdicts -> per-unit verdicts. `groups`: worker pod -> its group's leader (the
    unit); any other pod is its own unit. A unit's verdict is its worst member's (Wedged >
    Unreachable > Slow > Healthy, the leader first among equals); a Wedged one from a worker
    names that pod and says it is the group's."""
    out: dict[str, Verdict] = {}
    members: dict[str, list[str]] = {}
    for pod in verdicts:
        members.setdefault(groups.get(pod, pod), []).append(pod)
    for unit, pods in members.items():
        ordered = sorted(pods, key=lambda p: (p != unit, p))  # the leader first
        worst = max(ordered, key=lambda p: _rank(verdicts[p]))  # max keeps the first of equals
        verdict = verdicts[worst]
        if worst != unit and isinstance(verdict, Wedged):
            verdict = replace(verdict, details={**dict(verdict.details), "pod": worst, "group": unit})
        out[unit] = verdict
    return out


def unit_info(leader: PodInfo, workers: list[PodInfo], size: int) -> PodInfo:
    """The group's PodInfo: Ready only when the leader and all size-1 workers are; restarting when
    any of them is; the leader's uid (a recreated group has a new leader)."""
    ready = leader.ready and len(workers) >= size - 1 and all(w.ready for w in workers)
    restarting = leader.restarting or any(w.restarting for w in workers)
    return replace(leader, ready=ready, restarting=restarting)
