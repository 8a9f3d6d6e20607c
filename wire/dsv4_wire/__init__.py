"""The wire contract between dsv4's parts, spelled once.

The engine, the router, the operator, the manifests it writes and `dsv4 up` all import their
labels, annotations, HTTP paths, metric names, engine flags and the admin-auth rule from here.
Nothing in this package imports another dsv4 package or a third-party one: it is the bottom
layer that every other layer may use.
"""

from dsv4_wire.auth import (
    ADMIN_TOKEN_ENV,
    PD_SECRET_ENV,
    admin_refusal,
    authorization_header,
    bearer_token,
    is_loopback,
    token_matches,
)
from dsv4_wire.errors import APIError
from dsv4_wire.flags import EngineFlags
from dsv4_wire.k8s import (
    ANNOTATION_PINNED_REVISION,
    ANNOTATION_PLANNER_DRAIN,
    ANNOTATION_REMEDIATION_STATE,
    ANNOTATION_REVISION,
    ANNOTATION_REVISIONS,
    APP,
    ENGINE_CONTAINER,
    ENGINE_ROLES,
    LABEL_COMPONENT,
    LABEL_DEPLOYMENT,
    LABEL_DRAINING,
    LABEL_ENGINE_KIND,
    LABEL_EVIDENCE,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_POD,
    LABEL_ROLE,
    MANAGER,
    ROLES,
    controller_of,
    engine_statefulset_name,
    owned_engine_pod,
)
from dsv4_wire.metrics import COUNTERS, GAUGES, HISTOGRAMS, PREFIX, metric_name
from dsv4_wire.paths import Paths

__all__ = [
    "ADMIN_TOKEN_ENV",
    "PD_SECRET_ENV",
    "admin_refusal",
    "is_loopback",
    "authorization_header",
    "bearer_token",
    "token_matches",
    "APIError",
    "EngineFlags",
    "ANNOTATION_PINNED_REVISION",
    "ANNOTATION_PLANNER_DRAIN",
    "ANNOTATION_REMEDIATION_STATE",
    "ANNOTATION_REVISION",
    "ANNOTATION_REVISIONS",
    "APP",
    "ENGINE_CONTAINER",
    "ENGINE_ROLES",
    "LABEL_COMPONENT",
    "LABEL_DEPLOYMENT",
    "LABEL_DRAINING",
    "LABEL_ENGINE_KIND",
    "LABEL_EVIDENCE",
    "LABEL_INSTANCE",
    "LABEL_MANAGED_BY",
    "LABEL_NAME",
    "LABEL_POD",
    "LABEL_ROLE",
    "MANAGER",
    "ROLES",
    "controller_of",
    "engine_statefulset_name",
    "owned_engine_pod",
    "COUNTERS",
    "GAUGES",
    "HISTOGRAMS",
    "PREFIX",
    "metric_name",
    "Paths",
]
