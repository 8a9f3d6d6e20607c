"""Multi-node engine groups as the router and the operator see them: which pods form one engine.

A role with nodesPerReplica N > 1 runs each replica as a group of N pods, made by a LeaderWorkerSet
or by the operator's StatefulSet pair; both name pods alike:

  leader   <instance>-<role>-<g>       controlled by the StatefulSet <instance>-<role>
  workers  <instance>-<role>-<g>-<w>   controlled by the StatefulSet <instance>-<role>-<g>, w = 1..N-1

The leader (node 0) is the engine's endpoint: the one worker the router routes to and the
watchdog drains and restarts; the workers run ranks only. A group serves only when it is whole:
every worker there, running, ready and not terminating (no half-group is ever routed to).
Pure: pod objects (dicts) in, names out.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

from dsv4_wire.k8s import LABEL_GROUP_SIZE, LABEL_NODE, NODE_WORKER, controller_of, engine_statefulset_name


def _meta(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    return pod.get("metadata") or {}


def group_size(pod: Mapping[str, Any]) -> int:
    """The size of the pod's group (1: a single-node engine)."""
    try:
        return max(1, int((_meta(pod).get("labels") or {}).get(LABEL_GROUP_SIZE) or 1))
    except ValueError:
        return 1


def is_worker_node(pod: Mapping[str, Any]) -> bool:
    return (_meta(pod).get("labels") or {}).get(LABEL_NODE) == NODE_WORKER


def group_member(pod: Mapping[str, Any], instance: str, role: str) -> Optional[tuple[str, int]]:
    """(group name, node rank) of an engine pod of this deployment's role, by its controller: the
    role's StatefulSet makes leaders (node 0, the group named after the pod), a StatefulSet named
    after a leader makes that group's workers (node = the pod's ordinal). None otherwise."""
    meta = _meta(pod)
    name = str(meta.get("name") or "")
    ctrl = controller_of(meta)
    if ctrl is None or ctrl[0] != "StatefulSet" or not name:
        return None
    leaders = engine_statefulset_name(instance, role)
    if ctrl[1] == leaders:
        return name, 0
    group = ctrl[1]
    index = group[len(leaders) + 1 :] if group.startswith(leaders + "-") else ""
    ordinal = name[len(group) + 1 :] if name.startswith(group + "-") else ""
    if index.isdigit() and ordinal.isdigit() and int(ordinal) >= 1:
        return group, int(ordinal)
    return None


def _serving(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if _meta(pod).get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def whole_groups(pods: Iterable[Mapping[str, Any]], instance: str, role: str) -> set[str]:
    """Leaders (by name) of this role's groups of more than one node whose every worker is
    there, running, ready and not terminating. A leader's own state is its caller's to judge."""
    sizes: dict[str, int] = {}
    ready: dict[str, set[int]] = {}
    for pod in pods:
        member = group_member(pod, instance, role)
        if member is None:
            continue
        group, node = member
        if node == 0:
            sizes[group] = group_size(pod)
        elif _serving(pod):
            ready.setdefault(group, set()).add(node)
    return {g for g, n in sizes.items() if n > 1 and set(range(1, n)) <= ready.get(g, set())}


def routable_leader(pod: Mapping[str, Any], pods: Iterable[Mapping[str, Any]], instance: str, role: str) -> bool:
    """Pure: whether this pod may take traffic as far as groups go: a single-node engine always;
    a group's worker never; a group's leader only while its group is whole."""
    if is_worker_node(pod):
        return False
    if group_size(pod) <= 1:
        return True
    member = group_member(pod, instance, role)
    return member is not None and member[1] == 0 and member[0] in whole_groups(pods, instance, role)
