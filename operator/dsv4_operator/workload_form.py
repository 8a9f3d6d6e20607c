"""Which form a multi-node role takes on this cluster, and clearing the other form away. Thin I/O
around dsv4_operator.groups and manifests.

The LeaderWorkerSet API is detected (discovery of leaderworkerset.x-k8s.io/v1), not configured:
a cluster that serves it gets LeaderWorkerSets, any other the StatefulSet pair. The answer is
kept for LWS_RECHECK_S, so an LWS installed later is picked up at a later reconcile.
"""

from __future__ import annotations

import time
from typing import Optional

from dsv4_operator import groups as G
from dsv4_operator.kube import ApiError, KubeApi, resource_path
from dsv4_operator.manifests import LABEL_MANAGED_BY, MANAGER, Owner, replaced_workloads
from dsv4_operator.spec import DSV4DeploymentSpec

LWS_RECHECK_S = 30.0
_seen: dict[str, tuple[float, bool]] = {}  # API server URL -> (when, LWS served)


async def lws_served(api: KubeApi, now: Optional[float] = None) -> bool:
    """Whether the API server serves LeaderWorkerSets (cached for LWS_RECHECK_S per server)."""
    now = time.monotonic() if now is None else now
    key = str(getattr(getattr(api, "configuration", None), "host", "") or id(api))
    cached = _seen.get(key)
    if cached is not None and now - cached[0] < LWS_RECHECK_S:
        return cached[1]
    try:
        served = await api.served_resources(G.LWS_API_VERSION)
    except ApiError:
        served = None
    found = bool(served) and G.LWS_PLURAL in (served or [])
    _seen[key] = (now, found)
    return found


def forget() -> None:
    """Drop the cached answers (tests that install the LWS CRD mid-way)."""
    _seen.clear()


async def remove_replaced(api: KubeApi, spec: DSV4DeploymentSpec, owner: Owner, lws: bool) -> list[str]:
    """Delete an engine role's workload of the other form (manifests.replaced_workloads) before
    the new one is applied: only one the operator made (its managed-by label), and never the
    StatefulSet a LeaderWorkerSet made for itself (it carries LWS's name label). Returns what
    was deleted."""
    deleted = []
    for api_version, kind, name in replaced_workloads(spec, owner, lws):
        live = await api.get(api_version, kind, owner.namespace, name)
        labels = ((live or {}).get("metadata") or {}).get("labels") or {}
        if live is None or labels.get(LABEL_MANAGED_BY) != MANAGER or G.LWS_NAME_LABEL in labels:
            continue
        plural = G.LWS_PLURAL if kind == G.LWS_KIND else "statefulsets"
        try:
            await api.request(
                "DELETE",
                resource_path(api_version, plural, owner.namespace, name),
                body={"preconditions": {"uid": live["metadata"]["uid"]}, "propagationPolicy": "Background"},
            )
        except ApiError as e:
            if e.status not in (404, 409):
                raise
        deleted.append(f"{kind}/{name}")
    return deleted
