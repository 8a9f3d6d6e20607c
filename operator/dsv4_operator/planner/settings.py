"""`spec.planner` of a DSV4Deployment: the settings of the roles with `scaling: planner`.

A part of the resource's schema (dsv4_operator.spec holds the rest and refers to these models;
the CRD is generated from both). Its own module: the planner's settings are their own subject.
Field names are the user-facing camelCase names, as in dsv4_operator.spec.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=False)


def _nested(model: type[BaseModel]) -> Any:
    """An optional sub-object: absent means all its defaults (the CRD says `default: {}`)."""
    return Field(default_factory=model, json_schema_extra={"default": {}})


def _rules(*rules: dict[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(rules)}


def cel(rule: str, message: str) -> dict[str, str]:
    """One `x-kubernetes-validations` entry (as dsv4_operator.spec.cel)."""
    return {"rule": rule, "message": message}


MSG_PLANNER_MIN_MAX = "planner: minReplicas must not exceed maxReplicas"


class PlannerRoleSpec(_Model):
    """The bounds the planner keeps one role's replicas within."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            cel(
                "!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
                MSG_PLANNER_MIN_MAX,
            )
        )
    )

    min_replicas: int = Field(1, ge=1, le=1000, description="Fewest replicas the planner keeps (at least 1).")
    max_replicas: int = Field(8, ge=1, le=1000, description="Most replicas the planner asks for.")

    @model_validator(mode="after")
    def _bounds(self) -> "PlannerRoleSpec":
        if self.min_replicas > self.max_replicas:
            raise ValueError(MSG_PLANNER_MIN_MAX)
        return self


class PlannerSpec(_Model):
    """Settings of `scaling: planner` (docs/operations.md, "The planner"): every interval the operator
    reads each engine's live load, forecasts the next interval's, and sets the prefill and decode
    replica counts that meet the TTFT and ITL targets with the fewest replicas."""

    interval_seconds: float = Field(30, ge=1, le=3600, description="Seconds between two decisions.")
    ttft_target_seconds: float = Field(
        2.0, ge=0.001, le=600, description="Time to first token the planner sizes prefill for (arrival to first token)."
    )
    itl_target_seconds: float = Field(
        0.05, ge=0.001, le=10, description="Time between two tokens of one stream the planner sizes decode for."
    )
    prefill: PlannerRoleSpec = _nested(PlannerRoleSpec)
    decode: PlannerRoleSpec = _nested(PlannerRoleSpec)
    target_utilization: float = Field(
        0.8,
        ge=0.05,
        le=1,
        description="Share of a replica's capacity at the targets the planner plans to fill; the rest is headroom "
        "for forecast error and bursts.",
    )
    hysteresis: float = Field(
        0.15,
        ge=0,
        lt=1,
        description="A scale-down needs the forecast load to fit one replica fewer at targetUtilization x "
        "(1 - hysteresis): a load near a boundary does not flap.",
    )
    scale_down_cooldown_seconds: int = Field(
        300,
        ge=0,
        le=86400,
        description="No scale-down of a role this long after a scale-up of it (or the operator's start); a "
        "scale-down also needs every decision of that window to allow it, and goes at most maxUnavailable "
        "replicas at a time.",
    )
    startup_seconds: int = Field(
        180,
        ge=0,
        le=86400,
        description="How long a new replica takes to serve (schedule, load the checkpoint): scale-ups forecast "
        "this far ahead. The operator measures start-ups and uses the longer of the two.",
    )
    drain_timeout_seconds: int = Field(
        120,
        ge=0,
        le=86400,
        description="Longest a scale-down waits for a drained replica's running requests to finish before it "
        "removes the replica (what is left then moves to other engines by the router's migration).",
    )
    burst_factor: float = Field(
        1.0,
        ge=1,
        le=20,
        description="Capacity is kept for this multiple of the role's load without bursts (the lowest of the "
        "last startupSeconds and cool-down): new replicas take startupSeconds to serve, so a burst faster than "
        "that is served by those running. Set it to the largest rise you expect within a start-up; 1: none kept.",
    )
    dry_run: bool = Field(False, description="Decide and post the Events, change no replica count.")
