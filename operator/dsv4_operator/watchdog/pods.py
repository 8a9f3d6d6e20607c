"""Pure: a DSV4Deployment's engine pods as the watchdog sees them, and its remediation settings.

A pod is scraped at ``status.podIP`` on the engine container's port named ``http``. It counts as
Ready only when Kubernetes says so (its readiness probe hit the engine's /ready), and a Ready pod
is known to have answered, so a silence from the first scrape can still end in ``unresponsive``.
Pods keep their names across restarts (StatefulSet), so the policy keys on the name; a new UID
is a new incarnation. A multi-node engine (a group of pods) is one unit named after its leader:
its workers are scraped too, and their verdicts fold into the leader's (watchdog.groups).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

from dsv4_operator.manifests import APP, HTTP_PORT_NAME, LABEL_INSTANCE, LABEL_NAME, LABEL_ROLE
from dsv4_operator.spec import RemediationSpec
from dsv4_operator.watchdog.groups import unit_info
from dsv4_operator.watchdog.policy import PodInfo, RemediationSettings
from dsv4_operator.watchdog.signals import ScrapeTarget
from dsv4_wire.groups import group_member, group_size
from dsv4_wire import ENGINE_CONTAINER, ENGINE_ROLES, engine_statefulset_name, owned_engine_pod  # noqa: F401
from dsv4_wire import LABEL_DRAINING as DRAINING_LABEL  # noqa: F401

# A revision that runs this many detection windows without a wedge becomes the stable revision
# (the rollback target): 10 minutes with the default window of 120 s.
STABLE_AFTER_WINDOWS = 5


@dataclass(frozen=True)
class EnginePod:
    name: str
    uid: Optional[str]
    role: str
    ip: Optional[str]
    port: Optional[int]
    ready: bool
    terminating: bool
    draining: bool
    restarting: bool = False  # the kubelet is restarting a container (it agrees something is wrong)
    group: Optional[str] = None  # a multi-node engine's pod: its group (its leader's name)
    group_size: int = 1
    node: int = 0  # its node rank in the group (0: the leader)

    @property
    def url(self) -> Optional[str]:
        if not self.ip or not self.port:
            return None
        host = f"[{self.ip}]" if ":" in self.ip else self.ip  # IPv6 pod IPs
        return f"http://{host}:{self.port}"


ROUTER_PODS = "router"  # the index's third key part for a deployment's router pods


def engine_pod_index_key(namespace: str, labels: Mapping[str, str]) -> Optional[tuple[str, ...]]:
    """The watchdog's pod index: (namespace, instance) -> that deployment's engine pods, and
    (namespace, instance, ROUTER_PODS) -> its router pods, kept current by one pod watch for the
    operator instead of a LIST per scrape per deployment."""
    instance = labels.get(LABEL_INSTANCE)
    if not instance:
        return None
    role = labels.get(LABEL_ROLE)
    if role in ENGINE_ROLES:
        return namespace, instance
    if role == ROUTER_PODS:
        return namespace, instance, ROUTER_PODS
    return None


def pod_snapshot(body: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of a Pod the watchdog reads, copied out of kopf's live body."""
    return {
        "metadata": dict(body.get("metadata") or {}),
        "spec": dict(body.get("spec") or {}),
        "status": dict(body.get("status") or {}),
    }


def engine_pod_watch_selector() -> str:
    """The label selector of the operator's one pod watch (engine and router pods of every deployment)."""
    return f"{LABEL_NAME}={APP},{LABEL_ROLE} in ({','.join((*ENGINE_ROLES, ROUTER_PODS))})"


def pod_selector(instance: str) -> str:
    """The label selector of a deployment's engine pods."""
    return f"{LABEL_INSTANCE}={instance},{LABEL_ROLE} in ({','.join(ENGINE_ROLES)})"


def _http_port(pod_spec: Mapping[str, Any], default_port: Optional[int]) -> Optional[int]:
    containers = list(pod_spec.get("containers") or [])
    ordered = [c for c in containers if c.get("name") == ENGINE_CONTAINER] + [
        c for c in containers if c.get("name") != ENGINE_CONTAINER
    ]
    for container in ordered:
        for port in container.get("ports") or []:
            if port.get("name") == HTTP_PORT_NAME and port.get("containerPort"):
                return int(port["containerPort"])
    return default_port


def _is_ready(status: Mapping[str, Any]) -> bool:
    if status.get("phase") not in (None, "Running"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def _is_restarting(status: Mapping[str, Any]) -> bool:
    for c in status.get("containerStatuses") or []:
        if (c.get("state") or {}).get("waiting"):
            return True  # CrashLoopBackOff, or coming back after a restart
        if int(c.get("restartCount") or 0) > 0 and not c.get("ready", True):
            return True
    return False


def engine_pod(obj: Mapping[str, Any], default_port: Optional[int] = None) -> Optional[EnginePod]:
    """A Pod object -> an EnginePod (None for a pod that is not a prefill/decode engine: wrong
    labels, or the right labels on a pod the deployment's StatefulSet does not control, which
    is never scraped with the admin token, drained or restarted)."""
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    role = labels.get(LABEL_ROLE)
    if role not in ENGINE_ROLES or not meta.get("name"):
        return None
    if not owned_engine_pod(meta, [engine_statefulset_name(str(labels.get(LABEL_INSTANCE) or ""), role)]):
        return None
    return _engine_pod(obj, role, default_port)


def _engine_pod(obj: Mapping[str, Any], role: str, default_port: Optional[int], node: int = 0) -> EnginePod:
    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    labels = meta.get("labels") or {}
    terminating = bool(meta.get("deletionTimestamp"))
    size = group_size(obj)
    member = group_member(obj, str(labels.get(LABEL_INSTANCE) or ""), role) if size > 1 else None
    return EnginePod(
        name=meta["name"],
        uid=meta.get("uid"),
        role=role,
        ip=status.get("podIP") or None,
        port=_http_port(obj.get("spec") or {}, default_port),
        ready=_is_ready(status) and not terminating,
        terminating=terminating,
        draining=labels.get(DRAINING_LABEL) == "true",
        restarting=_is_restarting(status),
        group=member[0] if member else None,
        group_size=size,
        node=node,
    )


def worker_pod(obj: Mapping[str, Any], default_port: Optional[int] = None) -> Optional[EnginePod]:
    """A worker of a multi-node engine (node > 0, controlled by the worker StatefulSet of a leader
    of the deployment's role, dsv4_wire.groups), or None. Scraped on its node agent's port
    (SGLang's workers have none: never scraped), drained and restarted only through its group."""
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    role = labels.get(LABEL_ROLE)
    if role not in ENGINE_ROLES or not meta.get("name"):
        return None
    member = group_member(obj, str(labels.get(LABEL_INSTANCE) or ""), role)
    if member is None or member[1] == 0:
        return None
    return _engine_pod(obj, role, None, node=member[1])


@dataclass(frozen=True)
class WatchPlan:
    targets: list[ScrapeTarget]  # pods with an address, not terminating (a group's workers too)
    pods: dict[str, PodInfo]  # every engine (a group once, by its leader), for the policy's budget
    answered_before: dict[str, bool]
    groups: dict[str, str] = field(default_factory=dict)  # worker pod -> its group's leader
    members: dict[str, list[EnginePod]] = field(default_factory=dict)  # leader -> its workers


def watch_plan(pods: Iterable[EnginePod], kind: str, workers: Iterable[EnginePod] = ()) -> WatchPlan:
    targets, infos, answered = [], {}, {}
    leaders = {p.name: p for p in pods}
    members: dict[str, list[EnginePod]] = {}
    for w in sorted(workers, key=lambda p: (p.group or "", p.node)):
        if w.group in leaders:  # a worker of a group whose leader is gone goes with it
            members.setdefault(w.group, []).append(w)
    for pod in sorted(leaders.values(), key=lambda p: p.name):
        info = PodInfo(role=pod.role, ready=pod.ready, uid=pod.uid, restarting=pod.restarting, draining=pod.draining)
        if pod.group_size > 1:
            info = unit_info(
                info,
                [PodInfo(role=w.role, ready=w.ready, restarting=w.restarting) for w in members.get(pod.name, [])],
                pod.group_size,
            )
        infos[pod.name] = info
        for p in (pod, *members.get(pod.name, [])):
            answered[p.name] = p.ready
            if p.url is not None and not p.terminating:
                targets.append(ScrapeTarget(p.name, p.url, p.role, kind))
    groups = {w.name: leader for leader, ws in members.items() for w in ws}
    return WatchPlan(targets, infos, answered, groups, members)


def group_status(pods: Iterable[EnginePod], members: Mapping[str, list[EnginePod]]) -> dict[str, Any]:
    """status.groups: each multi-node engine with its pods ({} when the deployment has none)."""
    out = []
    for leader in sorted((p for p in pods if p.group_size > 1), key=lambda p: p.name):
        group = [leader, *members.get(leader.name, [])]
        ready = sum(1 for p in group if p.ready)
        out.append(
            {
                "name": leader.name,
                "role": leader.role,
                "ready": ready == leader.group_size and len(group) == leader.group_size,
                "nodes": f"{ready}/{leader.group_size}",
                "pods": [{"name": p.name, "node": p.node, "ready": p.ready} for p in group],
            }
        )
    return {"groups": out} if out else {}


def remediation_settings(rem: RemediationSpec) -> RemediationSettings:
    return RemediationSettings(
        enabled=rem.enabled,
        dry_run=rem.dry_run,
        max_unavailable={"prefill": rem.max_unavailable.prefill, "decode": rem.max_unavailable.decode},
        cooldown_s=float(rem.cooldown_seconds),
        capture_evidence=rem.capture_evidence,
    )


def scrape_timeout(rem: RemediationSpec) -> float:
    """Long enough for a busy engine, short enough that a hung one does not stall the round."""
    return min(5.0, max(1.0, float(rem.scrape_interval_seconds)))


def stable_after_seconds(detection_window_s: float) -> float:
    return STABLE_AFTER_WINDOWS * detection_window_s
