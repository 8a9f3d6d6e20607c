"""The DSV4Deployment's status in code: pydantic models, the twin of the CRD's status schema
(`dsv4_operator.crd` generates it from `DSV4DeploymentStatus`). What fills it: `status` (from
the children) and the watchdog's daemon (its condition and fields)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from dsv4_operator.spec import _Model, _OpenModel

ConditionType = Literal["Available", "Progressing", "Degraded", "Wedged"]
CONDITION_TYPES: tuple[str, ...] = ("Available", "Progressing", "Degraded", "Wedged")


class Condition(_Model):
    type: ConditionType
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: Optional[str] = None
    observed_generation: Optional[int] = None


class RoleStatus(_Model):
    replicas: int = 0
    ready_replicas: int = 0
    updated_replicas: int = 0
    ready: str = Field("0/0", description="ready/desired, as kubectl shows it.")


class RemediationRecord(_OpenModel):
    time: Optional[str] = None
    pod: Optional[str] = None
    role: Optional[str] = None
    action: Optional[str] = None
    reason: Optional[str] = None
    dry_run: Optional[bool] = None


class DSV4DeploymentStatus(_Model):
    observed_generation: Optional[int] = None
    conditions: list[Condition] = Field(
        [],
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    prefill: Optional[RoleStatus] = None
    decode: Optional[RoleStatus] = None
    router: Optional[RoleStatus] = None
    revision: Optional[str] = Field(None, description="Hash of the spec last applied.")
    stable_revision: Optional[str] = Field(None, description="Last revision that ran without wedges.")
    pinned_revision: Optional[str] = Field(
        None, description="The revision the children run instead of the spec (a rollback pin), while it applies."
    )
    wedged_pods: Optional[int] = Field(None, ge=0)
    watched_by: Optional[str] = Field(
        None,
        description="Which operator serves this resource: its namespace (its host name when it runs outside a "
        "cluster). Written on every status update; empty: no operator watches this namespace (with the chart's "
        "defaults, only the release namespace is watched).",
    )
    groups: Optional[list[dict[str, Any]]] = Field(
        None,
        description="Multi-node engines (nodesPerReplica > 1), as the watchdog last saw them: each group's name (its "
        "leader's), role, ready, nodes (ready/size) and pods (name, node rank, ready).",
        json_schema_extra={"items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
    )
    routers: Optional[dict[str, Any]] = Field(
        None,
        description="The router pods as the watchdog last saw them: each pod's verdict (state, reason, and the "
        "evidence: details) and lastRestart, the last wedged router it restarted (only while another replica was "
        "ready and answering; else a wedge is reported only).",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    last_remediation: Optional[RemediationRecord] = None
    remediations_total: Optional[int] = Field(None, ge=0)
    canary: Optional[dict[str, Any]] = Field(
        None,
        description="The last canary: revision, role, pod, phase (Probing, Passed, Failed), the stable "
        "revision, the probe's figures and the evidence ConfigMap.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
