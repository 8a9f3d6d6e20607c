"""The operator's canary step, as a pure decision (the kopf handlers are to act on it; see
docs/operations.md, "Rolling out engine changes").

A change touches a role when the role's live StatefulSet pod template does not contain the
wanted one (`manifests.contains`, as `decode_held` reads it). Then, per reconcile:
- no canary for this revision yet: the role that changed (decode first if both) moves ONE pod —
  partition = replicas - 1, the highest ordinal — and every other engine role is held; the
  status records the canary (phase Probing);
- Probing: keep those partitions while the probe runs against that pod;
- Passed: hand the partitions back to the spec (the rollout continues, prefillFirst kept);
- Failed: pin the stable revision (pinning.py: the children are built from it, the spec is not
  touched), so the canary pod goes back to it, and report Degraded=CanaryFailed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional

PROBING, PASSED, FAILED = "Probing", "Passed", "Failed"


@dataclass(frozen=True)
class CanaryState:
    """status.canary: which revision's canary, on which pod, and how it went."""
    revision: str
    role: str
    pod: str
    phase: str = PROBING
    stable_revision: Optional[str] = None
    figures: dict = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Optional[Mapping[str, Any]]) -> Optional["CanaryState"]:
        if not d or not d.get("revision"):
            return None
        return cls(**{k: d[k] for k in ("revision", "role", "pod", "phase", "stable_revision", "figures") if k in d})


@dataclass(frozen=True)
class CanaryStep:
    action: str  # none | start | probe | continue | revert
    partitions: Mapping[str, int] = field(default_factory=dict)  # role -> partition to apply (others: as usual)
    state: Optional[CanaryState] = None  # what status.canary should say
    event: Optional[tuple[str, str]] = None  # (reason, message) to post, once


def changed_roles(live_templates: Mapping[str, Optional[Mapping[str, Any]]],
                  wanted_templates: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Engine roles whose live pod template lacks the wanted one, decode first. A role with no
    live StatefulSet is new, not changed: it has no stable pods to protect."""
    from dsv4_operator.manifests import contains

    out = [role for role in ("decode", "prefill")
           if live_templates.get(role) is not None and role in wanted_templates
           and not contains(live_templates[role], wanted_templates[role])]
    return out


def plan(enabled: bool, name: str, revision: str, stable_revision: Optional[str], changed: list[str],
         replicas: Mapping[str, int], state: Optional[CanaryState], hold_partition: int) -> CanaryStep:
    """The canary step for this reconcile (see the module's docstring)."""
    if state is not None and state.revision == revision:
        if state.phase == PROBING:
            return CanaryStep("probe", _partitions(state.role, replicas, hold_partition), state)
        if state.phase == PASSED:
            return CanaryStep("continue", {}, state)
        return CanaryStep("revert", {}, state, ("CanaryFailed", f"revision {revision}: the canary {state.pod} failed "
                                                                f"its probe; back on {state.stable_revision}"))
    if not enabled or not changed or stable_revision is None or revision == stable_revision:
        return CanaryStep("none")
    role = changed[0]
    n = int(replicas.get(role, 1))
    pod = f"{name}-{role}-{n - 1}"
    st = CanaryState(revision=revision, role=role, pod=pod, stable_revision=stable_revision)
    return CanaryStep("start", _partitions(role, replicas, hold_partition), st,
                      ("CanaryStarted", f"revision {revision}: {pod} moves first and is probed; the rest wait"))


def _partitions(role: str, replicas: Mapping[str, int], hold: int) -> dict[str, int]:
    out = {r: hold for r in ("prefill", "decode")}
    out[role] = max(int(replicas.get(role, 1)) - 1, 0)
    return out


def degraded_condition(state: CanaryState, verdict_summary: str, evidence: Optional[str]) -> dict[str, Any]:
    """status.conditions entry of a failed canary (figures live in status.canary)."""
    message = f"canary {state.pod} (revision {state.revision}) failed: {verdict_summary}"
    if evidence:
        message += f"; evidence: ConfigMap {evidence}"
    return {"type": "Degraded", "status": "True", "reason": "CanaryFailed", "message": message}
