"""The operator's canary step, as pure decisions (docs/operations.md, "Rolling out engine changes").
The reconciler (handlers.effective_spec) and the canary daemon (dsv4_operator.rollout) both read
them; neither decides on its own.

The record (annotation ANNOTATION_CANARY on the DSV4Deployment, written by the daemon) holds the
baseline — the serving spec the fleet runs, and its revision — and the last canary's state. A
spec whose engine pod template differs from the baseline's is gated:
- Probing: the decode StatefulSet moves ONE pod (partition = its ordinal: the highest of the pods
  that run — the spec's replicas - 1, or the workload's live count - 1 where the planner or an
  autoscaler sets it, as the daemon recorded it),
  prefill is held (HOLD_PARTITION), and both apply at once (the prefillFirst hold would stop
  decode); the daemon probes that pod;
- Passed: the baseline becomes this spec and the gate opens: the rollout goes on as usual
  (prefillFirst kept);
- Failed: the children are built from the baseline spec (the spec is not touched), so the canary
  pod goes back to the stable revision; status says Degraded=CanaryFailed until the next edit.
Only decode is probed: the router pins requests to a decode (or mono) engine, not to a prefill,
so a change to prefill alone rolls without a canary (the daemon says so in an Event).
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional

from dsv4_operator.watchdog.revisions import serving_spec, spec_hash

if TYPE_CHECKING:
    from dsv4_operator.spec import DSV4DeploymentSpec

ANNOTATION_CANARY = "serving.dsv4.dev/canary"
PROBING, PASSED, FAILED = "Probing", "Passed", "Failed"
GATE_OPEN, GATE_PROBING, GATE_REVERTED = "open", "probing", "reverted"


@dataclass(frozen=True)
class CanaryState:
    """status.canary: which revision's canary, on which pod, and how it went."""

    revision: str
    role: str
    pod: str
    phase: str = PROBING
    stable_revision: Optional[str] = None
    figures: dict = field(default_factory=dict)
    evidence: Optional[str] = None  # the evidence ConfigMap of a failed canary
    summary: Optional[str] = None  # the verdict in words

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: Optional[Mapping[str, Any]]) -> Optional["CanaryState"]:
        if not d or not d.get("revision"):
            return None
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass(frozen=True)
class CanaryRecord:
    baseline_revision: Optional[str] = None
    baseline_spec: Optional[dict] = None  # serving_spec() of the spec the fleet runs
    state: Optional[CanaryState] = None

    @classmethod
    def from_annotations(cls, annotations: Optional[Mapping[str, str]]) -> Optional["CanaryRecord"]:
        text = (annotations or {}).get(ANNOTATION_CANARY)
        if not text:
            return None
        try:
            d = json.loads(text)
            return cls(d.get("baselineRevision"), d.get("baselineSpec"), CanaryState.from_dict(d.get("state")))
        except (ValueError, TypeError, AttributeError):
            return None  # unreadable: as if none (the daemon writes a fresh baseline)

    def to_annotation(self) -> str:
        return json.dumps(
            {
                "baselineRevision": self.baseline_revision,
                "baselineSpec": self.baseline_spec,
                "state": self.state.to_dict() if self.state else None,
            },
            sort_keys=True,
        )


@dataclass(frozen=True)
class CanaryStep:
    action: str  # none | baseline | probe | skip | wait
    state: Optional[CanaryState] = None  # the canary to probe (action probe)
    reason: str = ""


def serving_revision(raw_spec: Optional[Mapping[str, Any]]) -> str:
    """The revision of what is served (the remediation section left out, as the watchdog's history)."""
    return spec_hash(dict(raw_spec or {}))


def changed_roles(baseline: "DSV4DeploymentSpec", wanted: "DSV4DeploymentSpec", name: str) -> list[str]:
    """Engine roles (decode first) whose pod template differs between the baseline and the wanted
    spec, and that have pods to protect."""
    from dsv4_operator.manifests import Owner, engine_statefulset

    owner = Owner(name, "", "")
    return [
        role
        for role in ("decode", "prefill")
        if baseline.role(role).replicas > 0
        and wanted.role(role).replicas > 0
        and engine_statefulset(baseline, owner, role)["spec"]["template"]
        != engine_statefulset(wanted, owner, role)["spec"]["template"]
    ]


def canary_enabled(spec: "DSV4DeploymentSpec") -> bool:
    """The canary runs for builtin engines: the probe goes through our router's pin header."""
    return spec.rollout.canary.enabled and spec.engine.kind == "builtin"


def gate(record: Optional[CanaryRecord], revision: str, changed: list[str], enabled: bool) -> str:
    """What the children are built from for this revision (see the module's docstring)."""
    if record is None or record.baseline_revision is None or record.baseline_revision == revision:
        return GATE_OPEN
    if not enabled or "decode" not in changed:
        return GATE_OPEN
    st = record.state
    if st is not None and st.revision == revision:
        if st.phase == PASSED:
            return GATE_OPEN
        if st.phase == FAILED:
            return GATE_REVERTED
    return GATE_PROBING


def live_replicas(spec: "DSV4DeploymentSpec", role: str, live: Optional[Mapping[str, int]] = None) -> Optional[int]:
    """How many pods of `role` run: the spec's count where the operator owns it; the workload's
    own where the planner or an autoscaler sets it (`live`, read from the workload), None when
    that is not known."""
    if not spec.replicas_from_workload(role):
        return spec.role(role).replicas
    return (live or {}).get(role)


def canary_pod(
    name: str, spec: "DSV4DeploymentSpec", role: str = "decode", live: Optional[Mapping[str, int]] = None
) -> Optional[str]:
    """The pod the canary moves and probes: the highest ordinal of the pods that run (the one a
    partition of count - 1 moves). None when the live count of a planned/external role is not known."""
    n = live_replicas(spec, role, live)
    return f"{name}-{role}-{n - 1}" if n else None


def pod_ordinal(pod: str) -> Optional[int]:
    tail = pod.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def probing_spec(
    spec: "DSV4DeploymentSpec", hold_partition: int, role: str = "decode", canary: Optional[str] = None
) -> "DSV4DeploymentSpec":
    """The spec the children are built from while the canary is probed: one pod of `role` moves
    (a user's higher partition stands), the other engine role is held, both apply at once. The pod
    is `canary` (the daemon's record) or, before the daemon picked it, the highest ordinal of the
    spec's count; a role whose count is not the spec's (planner, external) is held until then:
    the spec's count minus one would move every pod above it, or none."""
    out = spec.model_copy(deep=True)
    ordinal = pod_ordinal(canary) if canary else None
    if ordinal is None and not spec.replicas_from_workload(role):
        ordinal = spec.role(role).replicas - 1
    for r in ("prefill", "decode"):
        rs = out.role(r)
        rs.partition = (
            max(rs.partition, ordinal if ordinal is not None else hold_partition) if r == role else hold_partition
        )
    out.rollout.order = "together"
    return out


def effective(
    name: str,
    spec: "DSV4DeploymentSpec",
    raw_spec: Optional[Mapping[str, Any]],
    annotations: Optional[Mapping[str, str]],
    hold_partition: int,
) -> tuple["DSV4DeploymentSpec", Optional[str]]:
    """(the spec to build the children from, the baseline revision when a failed canary put the
    fleet back on it). Anything unreadable opens the gate: the canary never blocks a rollout it
    cannot reason about."""
    from pydantic import ValidationError

    from dsv4_operator.spec import parse_spec

    record = CanaryRecord.from_annotations(annotations)
    if record is None or record.baseline_spec is None:
        return spec, None
    revision = serving_revision(raw_spec)
    if record.baseline_revision == revision:
        return spec, None
    try:
        baseline_raw = copy.deepcopy(record.baseline_spec)
        if raw_spec and "remediation" in raw_spec:
            baseline_raw["remediation"] = copy.deepcopy(raw_spec["remediation"])
        baseline = parse_spec(baseline_raw)
    except ValidationError:
        return spec, None
    g = gate(record, revision, changed_roles(baseline, spec, name), canary_enabled(spec))
    if g == GATE_PROBING:
        st = record.state
        canary = st.pod if st is not None and st.revision == revision and st.role == "decode" else None
        return probing_spec(spec, hold_partition, canary=canary), None
    if g == GATE_REVERTED:
        return baseline, record.baseline_revision
    return spec, None


def next_step(
    record: Optional[CanaryRecord],
    name: str,
    spec: "DSV4DeploymentSpec",
    raw_spec: Mapping[str, Any],
    live: Optional[Mapping[str, int]] = None,
) -> CanaryStep:
    """The daemon's next step for the spec as it is now (`live`: the roles' workloads' replicas,
    which the canary's pod is picked from where the planner or an autoscaler sets the count)."""
    from dsv4_operator.spec import parse_spec

    revision = serving_revision(raw_spec)
    if record is None or record.baseline_spec is None:
        return CanaryStep("baseline", reason="first revision seen: it is the baseline")
    if record.baseline_revision == revision:
        return CanaryStep("none")
    try:
        baseline = parse_spec(copy.deepcopy(record.baseline_spec))
    except ValueError:
        return CanaryStep("baseline", reason="the stored baseline is unreadable")
    changed = changed_roles(baseline, spec, name)
    g = gate(record, revision, changed, canary_enabled(spec))
    if g == GATE_REVERTED:
        return CanaryStep("none")
    if g == GATE_PROBING:
        if record.state is not None and record.state.revision == revision:
            return CanaryStep("probe", record.state)
        pod = canary_pod(name, spec, "decode", live)
        if pod is None:
            return CanaryStep("wait", reason="the decode workload's replica count is not known yet")
        return CanaryStep("probe", CanaryState(revision, "decode", pod, PROBING, record.baseline_revision))
    if changed and canary_enabled(spec):  # prefill alone changed: no canary can be pinned to it
        return CanaryStep(
            "skip",
            reason=f"revision {revision} changes only prefill's pod template: the router "
            "pins probes to decode engines only, so it rolls without a canary",
        )
    return CanaryStep("baseline", reason="no engine change to probe" if not changed else "canary disabled")


def with_baseline(
    record: Optional[CanaryRecord], raw_spec: Mapping[str, Any], state: Optional[CanaryState] = None
) -> CanaryRecord:
    """The record once `raw_spec` is what the fleet runs (kept: the last canary's state)."""
    keep = state if state is not None else (record.state if record is not None else None)
    return CanaryRecord(serving_revision(raw_spec), serving_spec(dict(raw_spec)), keep)


def with_state(record: CanaryRecord, state: CanaryState) -> CanaryRecord:
    return CanaryRecord(record.baseline_revision, record.baseline_spec, state)


def mark(annotations: Optional[Mapping[str, str]]) -> Optional[str]:
    """What of the record changes the children (the reconciler re-applies when it moves)."""
    record = CanaryRecord.from_annotations(annotations)
    st = record.state if record is not None else None
    # Only the state: a baseline moving on its own (first sight, a change with nothing to probe)
    # leaves the gate open before and after, so it needs no re-apply.
    return None if st is None else f"{st.revision}:{st.phase}"


def degraded_condition(state: CanaryState) -> dict[str, Any]:
    """status.conditions entry of a failed canary (figures live in status.canary)."""
    message = (
        f"canary {state.pod} (revision {state.revision}) failed its probe: {state.summary or 'see status.canary'}"
        f"; back on revision {state.stable_revision}, the spec is untouched: edit it to try again"
    )
    if state.evidence:
        message += f"; evidence: ConfigMap {state.evidence}"
    return {"type": "Degraded", "status": "True", "reason": "CanaryFailed", "message": message}


def failed_for(
    annotations: Optional[Mapping[str, str]], raw_spec: Optional[Mapping[str, Any]]
) -> Optional[CanaryState]:
    """The failed canary of the spec as it is now, if any (status: Degraded=CanaryFailed)."""
    record = CanaryRecord.from_annotations(annotations)
    st = record.state if record is not None else None
    if st is None or st.phase != FAILED or st.revision != serving_revision(raw_spec):
        return None
    return st
