"""Pure: what the children look like -> the DSV4Deployment's status.

Conditions (metav1.Condition shape; lastTransitionTime moves only when status flips):
  Available    prefill and decode each have a ready replica, and so has the router unless it is
               scaled to zero (a deployment served by its own gateway needs none).
  Progressing  the operator has not yet acted on the latest spec, or a role is not yet at its
               desired replicas, all updated and ready.
  Degraded     the operator cannot act (the spec is invalid or applying the children failed), a
               StatefulSet controller cannot create the pods (FailedCreate: Pod Security...), or
               wedges keep happening: a pod remediated REPEATED_WEDGES times without a quiet
               spell long enough for the watchdog to forget it (its policy state says so).
  Wedged       owned by the wedge watchdog; carried over unchanged, Unknown until it reports.
Fields the watchdog owns (wedgedPods, lastRemediation, remediationsTotal, stableRevision) are
carried over from the previous status as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

from dsv4_operator.manifests import HOLD_PARTITION, LABEL_ROLE
from dsv4_operator.spec import DSV4DeploymentSpec
from dsv4_operator.status_model import CONDITION_TYPES
from dsv4_operator.watchdog.policy import STATE_ANNOTATION, PolicyState

ROLES = ("prefill", "decode", "router")
REPEATED_WEDGES = 2  # remediations of one pod, not yet forgotten, that make the deployment Degraded
WATCHDOG_FIELDS = ("wedgedPods", "lastRemediation", "remediationsTotal", "stableRevision")


@dataclass(frozen=True)
class ChildObservation:
    """What a workload child (StatefulSet or Deployment) reports about itself."""

    role: str
    kind: str
    name: str
    spec_replicas: int
    generation: int
    observed_generation: int
    ready: int
    updated: int
    held: bool = False  # a decode StatefulSet kept on its old template until prefill rolled out
    created: int = 0  # pods its controller made (status.replicas), ready or not
    uid: Optional[str] = None

    @property
    def settled(self) -> bool:
        """Its controller has seen the latest spec and every replica runs it."""
        return self.observed_generation >= self.generation and self.updated >= self.spec_replicas


def observe(body: Mapping[str, Any]) -> Optional[ChildObservation]:
    """A StatefulSet / Deployment body -> an observation (None if it is not one of ours)."""
    meta = body.get("metadata") or {}
    role = (meta.get("labels") or {}).get(LABEL_ROLE)
    if role not in ROLES or body.get("kind") not in ("StatefulSet", "Deployment"):
        return None
    if any(ref.get("kind") == "Pod" for ref in meta.get("ownerReferences") or []):
        return None  # a multi-node group's workers (owned by its leader pod): the role's is the leaders' one
    spec = body.get("spec") or {}
    status = body.get("status") or {}
    return ChildObservation(
        role=role,
        kind=body["kind"],
        name=meta.get("name", ""),
        spec_replicas=int(spec.get("replicas", 1)),
        generation=int(meta.get("generation") or 0),
        observed_generation=int(status.get("observedGeneration") or 0),
        ready=int(status.get("readyReplicas") or 0),
        updated=int(status.get("updatedReplicas") or 0),
        held=((spec.get("updateStrategy") or {}).get("rollingUpdate") or {}).get("partition") == HOLD_PARTITION,
        created=int(status.get("replicas") or 0),
        uid=meta.get("uid"),
    )


def _condition(ctype: str, ok: Optional[bool], reason: str, message: str) -> dict[str, Any]:
    status = "Unknown" if ok is None else "True" if ok else "False"
    return {"type": ctype, "status": status, "reason": reason, "message": message}


def role_status(desired: int, child: Optional[ChildObservation]) -> dict[str, Any]:
    ready = child.ready if child else 0
    updated = child.updated if child else 0
    return {"replicas": desired, "readyReplicas": ready, "updatedReplicas": updated, "ready": f"{ready}/{desired}"}


class ApplyRefusal(str):
    """An apply error with its own Degraded reason (the message is the string itself)."""

    reason: str

    def __new__(cls, message: str, reason: str = "ApplyFailed") -> "ApplyRefusal":
        out = super().__new__(cls, message)
        out.reason = reason
        return out


# Degraded reasons that stand for "the children were not applied", carried until the next apply.
APPLY_REFUSAL_REASONS = (
    "ApplyFailed",
    "ImageVolumeUnsupported",
    "SecretOfAnotherDeployment",
    "SecretNotOwned",
    "SecretUnusable",
)


def compute_status(
    *,
    spec: Optional[DSV4DeploymentSpec],
    generation: int,
    observed_generation: Optional[int],
    children: Iterable[ChildObservation],
    previous: Optional[Mapping[str, Any]],
    now: str,
    spec_error: Optional[str] = None,
    apply_error: Optional[str] = None,
    revision: Optional[str] = None,
    remediation_counts: Optional[Mapping[str, int]] = None,
    pinned_revision: Optional[str] = None,
    canary: Any = None,
    canary_failed: Any = None,
    creation_failures: Optional[Mapping[str, str]] = None,
    watched_by: Optional[str] = None,
) -> dict[str, Any]:
    """The whole new status. `spec` is None when the spec is invalid (then `spec_error` says why);
    `observed_generation` is the generation the operator last acted on (applied or rejected).
    `remediation_counts`: pod -> remediations the watchdog still remembers (its policy state).
    `creation_failures`: role -> why its controller cannot make its pods (pod_creation).
    `watched_by`: who serves it (`operator_identity`), so `kubectl get dsv4d -A` tells a watched
    namespace from one no operator reads (whose resources never get a status)."""
    previous = dict(previous or {})
    by_role: dict[str, ChildObservation] = {}
    for child in children:
        by_role[child.role] = child

    def wanted(role: str) -> int:
        """The spec's count; for a role scaled from outside, what its workload says now."""
        child = by_role.get(role)
        if spec is None or (spec.replicas_from_workload(role) and child is not None):
            return child.spec_replicas if child is not None else 0
        return spec.router.replicas if role == "router" else spec.role(role).replicas

    desired = {role: wanted(role) for role in ROLES}
    roles = {role: role_status(desired[role], by_role.get(role)) for role in ROLES}

    unavailable = [
        role for role in ROLES if roles[role]["readyReplicas"] < 1 and not (role == "router" and desired[role] == 0)
    ]
    available = _condition(
        "Available",
        not unavailable,
        "MinimumReplicasAvailable" if not unavailable else "NoReadyReplicas",
        "every role has a ready replica" if not unavailable else f"no ready replica: {', '.join(unavailable)}",
    )

    summary = ", ".join(f"{role} {roles[role]['ready']} ready" for role in ROLES)
    if spec is None:
        progressing = _condition("Progressing", False, "InvalidSpec", "the spec cannot be acted on")
    else:
        behind = [
            role
            for role in ROLES
            if role not in by_role
            or by_role[role].spec_replicas != desired[role]
            or not by_role[role].settled
            or by_role[role].ready < desired[role]
        ]
        pending = observed_generation is None or observed_generation < generation
        if pending:
            progressing = _condition("Progressing", True, "SpecChanged", f"generation {generation} not yet applied")
        elif behind:
            held = [role for role in behind if role in by_role and by_role[role].held]
            note = f"; {', '.join(held)} waits for prefill to roll out first" if held else ""
            failing = [role for role in behind if role in (creation_failures or {})]
            note += f"; {', '.join(failing)} pods cannot be created (see Degraded)" if failing else ""
            progressing = _condition("Progressing", True, "RollingOut", summary + note)
        else:
            progressing = _condition("Progressing", False, "RolloutComplete", summary)

    if spec_error is not None:
        degraded = _condition("Degraded", True, "InvalidSpec", spec_error)
    elif apply_error is not None:
        degraded = _condition("Degraded", True, getattr(apply_error, "reason", "ApplyFailed"), apply_error)
    elif creation_failures:
        degraded = _condition(
            "Degraded",
            True,
            "FailedCreate",
            "; ".join(f"{role}: {creation_failures[role]}" for role in ROLES if role in creation_failures),
        )
    elif canary_failed is not None:  # the spec as written failed its canary: the fleet runs the stable revision
        from dsv4_operator.canary.plan import degraded_condition

        degraded = degraded_condition(canary_failed)
    else:
        repeated = sorted(p for p, n in (remediation_counts or {}).items() if n >= REPEATED_WEDGES)
        if repeated:
            counts = ", ".join(f"{p} x{(remediation_counts or {})[p]}" for p in repeated)
            degraded = _condition(
                "Degraded",
                True,
                "RepeatedWedges",
                f"wedges keep coming back after restarts ({counts}): read the evidence "
                "ConfigMaps and consider a rollback",
            )
        else:
            degraded = _condition("Degraded", False, "AsExpected", "the operator can act on the spec")

    prev_conditions = {c.get("type"): c for c in previous.get("conditions") or []}
    wedged = prev_conditions.get("Wedged") or _condition(
        "Wedged", None, "NotEvaluated", "the wedge watchdog has not reported"
    )

    conditions = []
    for cond in (available, progressing, degraded, wedged):
        cond = dict(cond)
        before = prev_conditions.get(cond["type"])
        if before is not None and before.get("status") == cond["status"] and before.get("lastTransitionTime"):
            cond["lastTransitionTime"] = before["lastTransitionTime"]
        else:
            cond.setdefault("lastTransitionTime", now)
        if cond["type"] != "Wedged" and observed_generation is not None:
            cond["observedGeneration"] = observed_generation
        conditions.append(cond)
    assert [c["type"] for c in conditions] == list(CONDITION_TYPES)

    status: dict[str, Any] = {"conditions": conditions, **roles}
    if observed_generation is not None:
        status["observedGeneration"] = observed_generation
    if revision is not None:
        status["revision"] = revision
    elif previous.get("revision") is not None:
        status["revision"] = previous["revision"]
    # Always written (null clears it): whether the children run a pinned revision, not the spec.
    status["pinnedRevision"] = pinned_revision
    if canary is not None and getattr(canary, "state", None) is not None:
        status["canary"] = canary.state.to_dict()  # the canary daemon's record (dsv4_operator.rollout)
    for key in WATCHDOG_FIELDS:
        if key in previous:
            status[key] = previous[key]
    status.setdefault("wedgedPods", 0)
    if watched_by:
        status["watchedBy"] = watched_by
    return status


def operator_identity(env: Mapping[str, str], hostname: str) -> str:
    """What `status.watchedBy` says: the operator's namespace (the chart sets POD_NAMESPACE), or
    the host it runs on when it runs outside a cluster."""
    return env.get("POD_NAMESPACE") or hostname


def remediation_counts(annotations: Optional[Mapping[str, str]]) -> dict[str, int]:
    """pod -> remediations remembered, from the watchdog's policy-state annotation (unreadable
    state counts as none: the watchdog rewrites it)."""
    text = (annotations or {}).get(STATE_ANNOTATION)
    try:
        state = PolicyState.from_json(text)
    except (ValueError, TypeError, KeyError):
        return {}
    return {pod: h.count for pod, h in state.history.items()}


def status_changed(old: Optional[Mapping[str, Any]], new: Mapping[str, Any]) -> bool:
    """True when writing `new` would change what is stored."""
    old = dict(old or {})
    return any(old.get(k) != v for k, v in new.items())
