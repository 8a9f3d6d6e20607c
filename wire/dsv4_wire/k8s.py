"""Kubernetes names both sides read: labels the operator writes and the router selects on,
annotations the operator keeps its own state in, the engine container and the roles."""

APP = "dsv4"
MANAGER = "dsv4-operator"

# Standard labels.
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"

# Ours. The router drops a pod labelled draining=true from its rotation (SGLang's router drops a
# pod that stops matching its selector, which the label also does for a `!draining` selector).
LABEL_ROLE = "serving.dsv4.dev/role"
LABEL_DRAINING = "serving.dsv4.dev/draining"
LABEL_ENGINE_KIND = "serving.dsv4.dev/engine-kind"
LABEL_EVIDENCE = "serving.dsv4.dev/evidence"
LABEL_DEPLOYMENT = "serving.dsv4.dev/deployment"
LABEL_POD = "serving.dsv4.dev/pod"
# Multi-node engines (a role's nodesPerReplica > 1): every pod of a group says the group's size and
# whether it is the group's leader (node 0: the engine's endpoint) or a worker (ranks only); the
# pods a worker StatefulSet of the operator's own makes also name their group (its leader pod).
LABEL_GROUP_SIZE = "serving.dsv4.dev/group-size"
LABEL_NODE = "serving.dsv4.dev/node"
LABEL_GROUP = "serving.dsv4.dev/group"
NODE_LEADER = "leader"
NODE_WORKER = "worker"

ANNOTATION_REVISION = "serving.dsv4.dev/revision"
ANNOTATION_REVISIONS = "serving.dsv4.dev/revisions"
ANNOTATION_REMEDIATION_STATE = "serving.dsv4.dev/remediation-state"
# "<revision hash>@<generation>": while the resource is at that generation, the operator builds its
# children from that stored revision's spec instead (a rollback that leaves the spec alone).
ANNOTATION_PINNED_REVISION = "serving.dsv4.dev/pinned-revision"
# On a group leader's pod template (StatefulSet pair form): the pod template of its group's
# workers, as JSON; the operator makes each group's worker StatefulSet from its leader pod's copy,
# so a group's workers always run the leader's revision.
ANNOTATION_WORKER_TEMPLATE = "serving.dsv4.dev/worker-template"
# On an engine pod the operator's planner is draining to remove it (scale-down): the draining label
# keeps it out of the routers, this says whose drain it is (a restarted operator resumes it).
ANNOTATION_PLANNER_DRAIN = "serving.dsv4.dev/planner-drain"

ENGINE_CONTAINER = "engine"
ENGINE_ROLES = ("prefill", "decode")
ROLES = ("mono", "prefill", "decode")


def controller_of(meta: object) -> "tuple[str, str] | None":
    """(kind, name) of the object's controller: its ownerReference marked controller: true (the
    StatefulSet, for an engine pod). None when it has none."""
    refs = meta.get("ownerReferences") if isinstance(meta, dict) else None
    for ref in refs or []:
        if isinstance(ref, dict) and ref.get("controller") is True:
            return str(ref.get("kind") or ""), str(ref.get("name") or "")
    return None


def engine_statefulset_name(instance: str, role: str) -> str:
    """The StatefulSet that runs a deployment's engines of one role (the operator names it so)."""
    return f"{instance}-{role}"


def owned_engine_pod(meta: object, statefulsets: "tuple[str, ...] | list[str]") -> bool:
    """Labels can be put on any pod by whoever may create pods: an engine pod is one whose
    controller is one of the deployment's engine StatefulSets. Only those get traffic, the PD
    secret or the admin token."""
    return controller_of(meta) in {("StatefulSet", name) for name in statefulsets}
