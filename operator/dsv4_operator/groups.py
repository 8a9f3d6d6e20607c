"""Multi-node replicas (a role's nodesPerReplica N > 1): what the operator renders for them and how
it keeps a group whole. Pure: dicts in, dicts out; the kopf shell is handlers/groups.py.

One replica is a gang of N pods, one engine (`dsv4 serve --nnodes N`): the leader (node 0) serves
HTTP and PD, the workers run ranks only. Two forms, the same pods and names
(dsv4_wire.groups: leader <inst>-<role>-<g>, workers <inst>-<role>-<g>-<w>):

- LeaderWorkerSet (when its CRD is installed): one LWS <inst>-<role> with the leader and worker
  templates, size N, restartPolicy RecreateGroupOnPodRestart. LWS makes a leader StatefulSet and a
  worker StatefulSet per group, and recreates a whole group when any of its pods is recreated or a
  container restarts.
- The StatefulSet pair (otherwise): the leader StatefulSet <inst>-<role> (the role's usual one, its
  template the leader's), and, for each leader pod, a worker StatefulSet named after it, owned by
  it (so it goes with it), made by the operator from the worker template its leader pod carries
  (ANNOTATION_WORKER_TEMPLATE: a group's workers run its leader's revision, a canary's included).
  The operator recreates a group the way LWS does (`recreate_decision`), with exponential backoff.

Either way: node 0's address for --dist-init-addr is the leader's DNS name in the role's headless
Service (<leader>.<inst>-<role>.<namespace>; the leader itself uses its pod IP); a worker's node
rank is its ordinal (worker StatefulSets start at ordinal 1). Node affinity keeps a group in one
domain of `groupTopology.key` (a rack, an NVLink domain). The role's PodDisruptionBudget counts
whole groups (manifests.engine_disruption_budget).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from dsv4_operator import spec as S
from dsv4_operator.spec import DSV4DeploymentSpec
from dsv4_wire import LABEL_INSTANCE, LABEL_ROLE, controller_of
from dsv4_wire.groups import group_member
from dsv4_wire.k8s import (
    ANNOTATION_WORKER_TEMPLATE,
    LABEL_GROUP,
    LABEL_GROUP_SIZE,
    LABEL_NODE,
    NODE_LEADER,
    NODE_WORKER,
)

LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_VERSION = "v1"
LWS_API_VERSION = f"{LWS_GROUP}/{LWS_VERSION}"
LWS_KIND = "LeaderWorkerSet"
LWS_PLURAL = "leaderworkersets"
# LeaderWorkerSet's own names (sigs.k8s.io/lws, api/leaderworkerset/v1): labels it puts on pods,
# the env it injects, the annotation of its exclusive placement.
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_GROUP_KEY_LABEL = "leaderworkerset.sigs.k8s.io/group-key"
LWS_EXCLUSIVE_TOPOLOGY = "leaderworkerset.sigs.k8s.io/exclusive-topology"
LWS_LEADER_ADDRESS = "$(LWS_LEADER_ADDRESS)"
# What the StatefulSet controller puts on its pods (Kubernetes 1.28+ for the pod index).
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
POD_NAME_LABEL = "statefulset.kubernetes.io/pod-name"

GROUP_PORT = S.GROUP_PORT  # --dist-init-addr's port on the leader (torch's rendezvous); +1: the node channel
NODE_RANK_ENV = "DSV4_NODE_RANK"
LEADER_ADDRESS_ENV = "DSV4_LEADER_ADDRESS"
NODE_RANK_REF = f"$({NODE_RANK_ENV})"
LEADER_ADDRESS_REF = f"$({LEADER_ADDRESS_ENV})"
LEADER_SELF_ADDRESS = "$(POD_IP)"  # the leader binds the rendezvous; workers reach it by DNS

# Group recreation backoff (StatefulSet pair form): the first recreation at once, then 30 s,
# doubling to 600 s while the group keeps failing; a group that ran RESET_AFTER_S starts over.
BACKOFF_FIRST_S = 30.0
BACKOFF_CAP_S = 600.0
RESET_AFTER_S = 600.0


def nodes(spec: DSV4DeploymentSpec, role: str) -> int:
    return spec.role(role).nodes_per_replica


def group_labels(spec: DSV4DeploymentSpec, role: str, node: str) -> dict[str, str]:
    return {LABEL_GROUP_SIZE: str(nodes(spec, role)), LABEL_NODE: node}


# ---- pod templates ----------------------------------------------------------------------------------


def worker_template(pod: Mapping[str, Any], spec: DSV4DeploymentSpec, role: str) -> dict[str, Any]:
    """A worker's pod template from an engine pod template built with node (NODE_RANK_REF,
    LEADER_ADDRESS_REF): no API, no PD bootstrap port, no drain (a worker node serves no request);
    probes on its node agent (builtin: /health, and /ready once the group serves); SGLang's
    workers serve no HTTP at all, so they have no port and no probe."""
    out = copy.deepcopy(dict(pod))
    meta = out.setdefault("metadata", {})
    meta["labels"] = {**(meta.get("labels") or {}), **group_labels(spec, role, NODE_WORKER)}
    builtin = spec.engine.kind == "builtin"
    if not builtin:
        meta["annotations"] = {
            k: v for k, v in (meta.get("annotations") or {}).items() if not k.startswith(("prometheus.io/", "sglang."))
        }
    container = out["spec"]["containers"][0]
    container.pop("lifecycle", None)
    container["ports"] = [p for p in container.get("ports") or [] if p.get("name") == "http"] if builtin else []
    if not builtin:
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            container.pop(probe, None)
    return out


def leader_template(
    pod: Mapping[str, Any], worker: Mapping[str, Any], spec: DSV4DeploymentSpec, role: str
) -> dict[str, Any]:
    """The leader's pod template (the role's StatefulSet's, or the LWS's leaderTemplate): the engine
    pod built with node ("0", LEADER_SELF_ADDRESS), its group labels, and its group's worker
    template as an annotation (the StatefulSet pair makes the workers from it; with a
    LeaderWorkerSet it is only carried, so the leader template is the same in both forms)."""
    out = copy.deepcopy(dict(pod))
    meta = out.setdefault("metadata", {})
    meta["labels"] = {**(meta.get("labels") or {}), **group_labels(spec, role, NODE_LEADER)}
    meta["annotations"] = {
        **(meta.get("annotations") or {}),
        ANNOTATION_WORKER_TEMPLATE: json.dumps(worker, sort_keys=True, separators=(",", ":")),
    }
    return out


def _with_env(template: dict[str, Any], env: list[dict[str, Any]]) -> dict[str, Any]:
    """Prepend env to the engine container (before the user's: these are the group's, fixed)."""
    container = template["spec"]["containers"][0]
    names = {e["name"] for e in env}
    container["env"] = [*env, *(e for e in container.get("env") or [] if e["name"] not in names)]
    return template


def _with_pod_affinity(template: dict[str, Any], term: dict[str, Any], required: bool) -> dict[str, Any]:
    """Add one podAffinity term to the template's affinity (the user's own terms kept)."""
    affinity = template["spec"].setdefault("affinity", {})
    pod_affinity = affinity.setdefault("podAffinity", {})
    if required:
        pod_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(term)
    else:
        pod_affinity.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append(
            {"weight": 100, "podAffinityTerm": term}
        )
    return template


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


# ---- the LeaderWorkerSet form ---------------------------------------------------------------------


def leaderworkerset(sts: Mapping[str, Any], spec: DSV4DeploymentSpec, role: str) -> dict[str, Any]:
    """The role's LeaderWorkerSet, from the role's leader StatefulSet as manifests builds it (same
    name, labels, owner, revision, replicas, partition and leader template)."""
    s = sts["spec"]
    leader = copy.deepcopy(s["template"])
    worker = json.loads(leader["metadata"]["annotations"][ANNOTATION_WORKER_TEMPLATE])
    _with_env(
        worker,
        [
            _field_env(NODE_RANK_ENV, f"metadata.labels['{LWS_WORKER_INDEX_LABEL}']"),
            # LWS puts LWS_LEADER_ADDRESS first in the env, so this reference expands.
            {"name": LEADER_ADDRESS_ENV, "value": LWS_LEADER_ADDRESS},
        ],
    )
    topo = spec.role(role).group_topology
    meta = copy.deepcopy(dict(sts["metadata"]))
    if topo.required:  # every pod of a group in one domain, one group per domain
        meta["annotations"] = {**(meta.get("annotations") or {}), LWS_EXCLUSIVE_TOPOLOGY: topo.key}
    else:  # workers prefer their own group's leader's domain
        term = {
            "labelSelector": {"matchLabels": {LWS_WORKER_INDEX_LABEL: "0"}},
            "matchLabelKeys": [LWS_GROUP_KEY_LABEL],
            "topologyKey": topo.key,
        }
        _with_pod_affinity(worker, term, required=False)
    out_spec: dict[str, Any] = {}
    if "replicas" in s:
        out_spec["replicas"] = s["replicas"]
    partition = ((s.get("updateStrategy") or {}).get("rollingUpdate") or {}).get("partition", 0)
    out_spec.update(
        {
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"partition": partition, "maxUnavailable": 1, "maxSurge": 0},
            },
            "leaderWorkerTemplate": {
                "size": nodes(spec, role),
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
            "networkConfig": {"subdomainPolicy": "Shared"},
        }
    )
    return {"apiVersion": LWS_API_VERSION, "kind": LWS_KIND, "metadata": meta, "spec": out_spec}


# ---- the StatefulSet pair form: a worker StatefulSet per leader pod ------------------------------------


def worker_statefulset(leader: Mapping[str, Any], topology_key: str, required: bool) -> Optional[dict[str, Any]]:
    """The worker StatefulSet of one leader pod (None when the pod carries no worker template):
    named after the leader, owned by it (deleted with it, so a recreated leader gets a new one),
    N-1 workers from ordinal 1 (each one's node rank), node 0's address its DNS name."""
    meta = leader.get("metadata") or {}
    raw = (meta.get("annotations") or {}).get(ANNOTATION_WORKER_TEMPLATE)
    ctrl = controller_of(meta)
    if not raw or ctrl is None or not meta.get("uid"):
        return None
    template = json.loads(raw)
    labels = dict(meta.get("labels") or {})
    size = int(labels.get(LABEL_GROUP_SIZE) or 1)
    service = ctrl[1]  # the leader StatefulSet's serviceName is its own name (manifests)
    name, namespace = meta["name"], meta.get("namespace")
    selector = {k: labels[k] for k in (LABEL_INSTANCE, LABEL_ROLE) if k in labels} | {LABEL_GROUP: name}
    template["metadata"]["labels"] = {**template["metadata"].get("labels", {}), LABEL_GROUP: name}
    _with_env(
        template,
        [
            _field_env(NODE_RANK_ENV, f"metadata.labels['{POD_INDEX_LABEL}']"),
            {"name": LEADER_ADDRESS_ENV, "value": f"{name}.{service}.{namespace}.svc"},
        ],
    )
    _with_pod_affinity(
        template, {"labelSelector": {"matchLabels": {POD_NAME_LABEL: name}}, "topologyKey": topology_key}, required
    )
    sts_labels = {k: v for k, v in labels.items() if not k.startswith(("apps.kubernetes.io/", "statefulset."))}
    sts_labels.pop("controller-revision-hash", None)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {**sts_labels, LABEL_NODE: NODE_WORKER, LABEL_GROUP: name},
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": name,
                    "uid": meta["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "replicas": size - 1,
            "ordinals": {"start": 1},
            "serviceName": service,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector},
            "template": template,
        },
    }


def worker_set_of(sts: Mapping[str, Any]) -> Optional[str]:
    """The leader pod uid a worker StatefulSet belongs to (its controller reference), or None."""
    for ref in (sts.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == "Pod" and ref.get("controller"):
            return ref.get("uid")
    return None


# ---- keeping a group whole (the StatefulSet pair form) ------------------------------------------------


def container_restarted(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") not in ("Running", "Pending"):
        return False
    return any(
        int(c.get("restartCount") or 0) > 0
        for c in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
    )


@dataclass
class GroupRecord:
    """One group's recreations (by leader pod name), for the backoff."""

    count: int = 0  # recreations in a row
    last_at: float = 0.0
    leader_uids: set = field(default_factory=set)  # incarnations recreated already: never twice


def backoff_s(count: int) -> float:
    """The wait before a group's recreation when it was recreated `count` times in a row before."""
    if count <= 0:
        return 0.0
    return min(BACKOFF_FIRST_S * 2 ** (count - 1), BACKOFF_CAP_S)


@dataclass(frozen=True)
class Recreate:
    """Delete this leader pod (its uid as precondition): its worker StatefulSet and workers go
    with it, its StatefulSet makes it anew, the operator makes its workers anew."""

    leader: str
    uid: str
    why: str
    wait_s: float = 0.0  # > 0: held by the backoff this long


def recreate_decision(
    pod: Mapping[str, Any],
    deleted: bool,
    leader: Optional[Mapping[str, Any]],
    worker_set_uid: Optional[str],
    record: Optional[GroupRecord],
    now: float,
    instance: str,
    role: str,
) -> Optional[Recreate]:
    """Pure: whether this pod's event means its group must be recreated (LWS's
    RecreateGroupOnPodRestart): a pod of the group deleted (a worker) or with a container
    restarted. Not for a pod of an older incarnation of the group (its worker StatefulSet is not
    the current leader's), not when the leader is already going, never twice for one leader
    incarnation. `worker_set_uid`: the uid of the live worker StatefulSet of the group, `leader`
    its live leader pod."""
    member = group_member(pod, instance, role)
    if member is None or leader is None:
        return None
    group, node = member
    lmeta = leader.get("metadata") or {}
    if lmeta.get("deletionTimestamp") or not lmeta.get("uid"):
        return None
    uid = lmeta["uid"]
    if node == 0:
        if (pod.get("metadata") or {}).get("uid") != uid or deleted:
            return None  # the leader's own deletion: its StatefulSet makes it anew, whole
        why = f"leader {group}: a container restarted"
    else:
        ctrl_uid = next(
            (r.get("uid") for r in (pod.get("metadata") or {}).get("ownerReferences") or [] if r.get("controller")),
            None,
        )
        if worker_set_uid is None or ctrl_uid != worker_set_uid:
            return None  # a worker of an older incarnation, going with it
        name = (pod.get("metadata") or {}).get("name")
        if deleted or (pod.get("metadata") or {}).get("deletionTimestamp"):
            why = f"worker {name} (node {node}) was deleted"
        elif container_restarted(pod):
            why = f"worker {name} (node {node}): a container restarted"
        else:
            return None
    if node == 0 and not container_restarted(pod):
        return None
    if record is not None and uid in record.leader_uids:
        return None
    count = 0 if record is None or now - record.last_at >= RESET_AFTER_S else record.count
    wait = max(0.0, (record.last_at if record else 0.0) + backoff_s(count) - now) if count else 0.0
    return Recreate(group, uid, why, wait)
