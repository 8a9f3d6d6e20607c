"""The DSV4Deployment resource in code: pydantic models of its spec (its status: `status_model`).

This is the in-code twin of the CustomResourceDefinition: `dsv4_operator.crd` generates the
CRD's openAPIV3Schema from these models, so a field, default, enum or minimum lives here once.
Field names are the user-facing camelCase names (aliases); Python code uses snake_case.

Unknown fields are ignored, as the API server prunes them from a structural schema: the
operator must accept whatever a newer CRD lets through rather than crash on it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from dsv4_operator import layout_rules as L
from dsv4_operator.planner.settings import MSG_PLANNER_MIN_MAX, PlannerRoleSpec, PlannerSpec  # noqa: F401  (part of the schema)

GROUP = "serving.dsv4.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DSV4Deployment"
PLURAL = "dsv4deployments"
SINGULAR = "dsv4deployment"
SHORT_NAMES = ["dsv4d"]

# GPU feature discovery labels every NVIDIA node with its architecture family; Blackwell is the
# default target, and tolerating the GPU taint lets the pods onto dedicated GPU pools.
DEFAULT_NODE_SELECTOR = {"nvidia.com/gpu.family": "blackwell"}
DEFAULT_TOLERATIONS = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]

# ---- Field syntax the API server checks at admission (patterns; map keys become CEL rules) ---
# Regexes avoid backslashes so they read the same in a CEL string literal, and use only syntax
# common to RE2 (CEL), Rust's regex (pydantic) and Python's re (jsonschema).

# A Kubernetes resource quantity, as apimachinery parses it: 4, "16Gi", "500m", "1e3".
QUANTITY_PATTERN = (
    r"^[+-]?(([0-9]+([.][0-9]*)?)|([.][0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?(([0-9]+([.][0-9]*)?)|([.][0-9]+))))?$"
)
# An environment variable name (the C identifier rule, plus '-' and '.', as the API server takes).
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
# A label / node-selector / resource key: [DNS-subdomain prefix "/"] name of up to 63 characters.
QUALIFIED_NAME_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
# A label value: empty, or up to 63 alphanumerics with '-', '_', '.' inside.
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"
DEADLINE_MARGIN_SECONDS = 30  # the default window outlasts the engine's longest PD deadline by this
SGLANG_DETECTION_WINDOW_SECONDS = 120
MAX_MAP_ENTRIES = 64  # bounds the maps the CEL rules walk (the API server budgets rule cost)
MAX_LIST_ITEMS = 256  # likewise for the lists whose items carry rules (env)

Quantity = Union[int, Annotated[str, Field(pattern=QUANTITY_PATTERN)]]  # 4, "16Gi", "500m"
QualifiedName = Annotated[str, Field(pattern=QUALIFIED_NAME_PATTERN, max_length=317)]
LabelValue = Annotated[str, Field(pattern=LABEL_VALUE_PATTERN, max_length=63)]


def cel(rule: str, message: str, field_path: Optional[str] = None) -> dict[str, str]:
    """One `x-kubernetes-validations` entry: the API server rejects an object where `rule`
    (CEL, `self` = this node) is false, with `message`."""
    out = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out


def _rules(*rules: dict[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(rules)}


# Rules the operator also checks at reconcile time (manifests.unbuildable_reasons); the CRD
# carries them as CEL so that `kubectl apply` refuses the resource instead.
MSG_ONE_VOLUME_SOURCE = "model.volume must give exactly one of persistentVolumeClaim, hostPath, image"
MSG_PORT_CLASH = "engine.port and transfer.bootstrapPort must differ: both are ports of the prefill pod"
MSG_ENV_VALUE_AND_FROM = "an env var gives value or valueFrom, not both"
MSG_EXISTS_WITH_VALUE = "a toleration with operator Exists must not give a value"
MSG_EMPTY_KEY_NEEDS_EXISTS = "a toleration without a key must use operator Exists"
MSG_SECONDS_NEED_NO_EXECUTE = "tolerationSeconds applies only to effect NoExecute"
SGLANG_ROUTER_METRICS_PORT = 29000  # sgl-router's Prometheus port, beside router.port in its pod
MSG_ROUTER_PORT_CLASH = f"router.port must not be {SGLANG_ROUTER_METRICS_PORT}: the SGLang router serves metrics there"
GROUP_PORT = 29500  # a multi-node engine's rendezvous on its leader (and +1: its node channel)
MSG_GROUP_PORT_CLASH = (
    f"with nodesPerReplica > 1, engine.port and transfer.bootstrapPort must not be {GROUP_PORT} or {GROUP_PORT + 1}: "
    "a group's leader listens there for its nodes"
)


def _nested(model: type[BaseModel]) -> Any:
    """An optional sub-object: absent means all its defaults (the CRD says `default: {}`)."""
    return Field(default_factory=model, json_schema_extra={"default": {}})


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=False)


class _OpenModel(_Model):
    """A record another component may extend (status written by the watchdog)."""

    model_config = ConfigDict(extra="allow")


# ---- Kubernetes building blocks used inside the spec --------------------------------------


class EnvVar(_Model):
    model_config = ConfigDict(
        json_schema_extra=_rules(cel("!(has(self.value) && has(self.valueFrom))", MSG_ENV_VALUE_AND_FROM))
    )

    name: str = Field(min_length=1, pattern=ENV_NAME_PATTERN, description="Environment variable name.")
    value: Optional[str] = Field(None, description="Literal value.")
    value_from: Optional[dict[str, Any]] = Field(
        None, description="A Kubernetes EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef, ...)."
    )


class Toleration(_Model):
    model_config = ConfigDict(
        json_schema_extra=_rules(
            cel(
                "!has(self.operator) || self.operator != 'Exists' || !has(self.value) || self.value == ''",
                MSG_EXISTS_WITH_VALUE,
            ),
            cel(
                "(has(self.key) && self.key != '') || (has(self.operator) && self.operator == 'Exists')",
                MSG_EMPTY_KEY_NEEDS_EXISTS,
            ),
            # The API server refuses the pod template otherwise (422), after the resource was accepted.
            cel(
                "!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
                MSG_SECONDS_NEED_NO_EXECUTE,
            ),
        )
    )

    key: Optional[Annotated[str, Field(pattern="^(" + QUALIFIED_NAME_PATTERN[1:-1] + ")?$")]] = None
    operator: Optional[Literal["Exists", "Equal"]] = None
    value: Optional[str] = None
    effect: Optional[Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]] = None
    toleration_seconds: Optional[int] = None


class Resources(_Model):
    limits: dict[QualifiedName, Quantity] = Field({}, max_length=MAX_MAP_ENTRIES)
    requests: dict[QualifiedName, Quantity] = Field({}, max_length=MAX_MAP_ENTRIES)


class PVCSource(_Model):
    claim_name: str = Field(min_length=1)
    read_only: bool = True


class HostPathSource(_Model):
    path: str = Field(pattern=r"^/")
    type: Optional[str] = None


class ImageSource(_Model):
    reference: str = Field(min_length=1, description="OCI image (or artifact) holding the checkpoint.")
    pull_policy: Optional[Literal["Always", "IfNotPresent", "Never"]] = None


class ModelVolume(_Model):
    """Where the checkpoint comes from; give exactly one source."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            cel(
                "(has(self.persistentVolumeClaim) ? 1 : 0) + (has(self.hostPath) ? 1 : 0) + (has(self.image) ? 1 : 0) == 1",
                MSG_ONE_VOLUME_SOURCE,
            )
        )
    )

    persistent_volume_claim: Optional[PVCSource] = None
    host_path: Optional[HostPathSource] = None
    image: Optional[ImageSource] = None


# ---- The spec ------------------------------------------------------------------------------


class ModelSpec(_Model):
    name: str = Field(min_length=1, description="Model name; the served name unless servedName is set.")
    path: str = Field(pattern=r"^/", description="Checkpoint folder inside the engine container.")
    served_name: Optional[str] = Field(None, description="Name clients use in requests (default: name).")
    volume: Optional[ModelVolume] = Field(
        None, description="Volume holding the checkpoint, mounted at mountPath (omit if the image has it)."
    )
    mount_path: str = Field("/models", pattern=r"^/")

    @property
    def served(self) -> str:
        return self.served_name or self.name


class EngineSpec(_Model):
    kind: Literal["builtin", "sglang"] = Field(
        "builtin", description="builtin runs `dsv4 serve`; sglang runs SGLang's own launch_server."
    )
    image: str = Field(min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    port: int = Field(8100, ge=1, le=65535, description="Engine HTTP port (API, /health, /metrics).")
    args: list[str] = Field([], description="Extra arguments for every engine.")
    env: list[EnvVar] = Field([], max_length=MAX_LIST_ITEMS)  # bounded: the API server budgets CEL cost
    kv_memory_fraction: Optional[float] = Field(
        None,
        gt=0,
        le=1,
        description="builtin: share of a GPU's memory free after the weights that the KV pool takes, less a "
        "reserve for CUDA graphs (`dsv4 serve --kv-memory-fraction`; unset: the engine's default, 0.9).",
    )
    cuda_graph_max_bs: Optional[int] = Field(
        None,
        ge=0,
        description="builtin: decode batches up to this many requests replay CUDA graphs (`dsv4 serve "
        "--cuda-graph-max-bs`; 0 turns them off; unset: the engine's default, on up to 64, falling back to "
        "eager decodes, reported in /v1/loads, when capture fails).",
    )


NODES_PER_REPLICA_DOC = (
    "Hosts (pods) one engine of this role spans. Above 1 a replica is a gang of pods, one engine with --tp-size "
    "gpusPerPod x nodesPerReplica (`dsv4 serve --nnodes`; node 0's rendezvous on port 29500 and 29501): a "
    "LeaderWorkerSet where its API is served, else a leader StatefulSet and a worker StatefulSet per group made "
    "by the operator. A group starts, serves and restarts as one; the role's PodDisruptionBudget counts whole "
    "groups. See docs/multi-node.md."
)
GROUP_TOPOLOGY_DOC = (
    "nodesPerReplica > 1: keep each group's pods in one domain of this node label (pod affinity to the group's "
    "leader; a LeaderWorkerSet's exclusive-topology when required)."
)


class GroupTopology(_Model):
    """Where a multi-node replica's pods go (nodesPerReplica > 1): into one domain of this node label."""

    key: QualifiedName = Field(
        "nvidia.com/gpu.clique",
        description="Node label naming the domain a group's pods share (a rack, an NVLink domain; GPU feature "
        "discovery labels GB200 nodes with nvidia.com/gpu.clique).",
    )
    required: bool = Field(
        False,
        description="false: the scheduler prefers one domain per group, and nodes without the label still take "
        "pods; true: a group's pods only ever share one domain (pods wait when none has room; with a "
        "LeaderWorkerSet, also one group per domain: its exclusive-topology).",
    )


class RoleSpec(_Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": L.ROLE_RULES})

    replicas: int = Field(1, ge=0)
    scaling: Literal["operator", "external", "planner"] = Field(
        "operator",
        description="operator: replicas is the count, and the operator puts it back if changed. external: an HPA, "
        "KEDA or `kubectl scale` owns the workload's replicas; replicas is only the count it starts with. "
        "planner: the operator's planner sets the count against the TTFT/ITL targets of spec.planner, within its "
        "minReplicas..maxReplicas; replicas is the count it starts with.",
    )
    gpus_per_pod: int = Field(4, ge=0, description="nvidia.com/gpu per pod (0: no GPU request).")
    nodes_per_replica: int = Field(1, ge=1, le=64, description=NODES_PER_REPLICA_DOC)
    group_topology: GroupTopology = Field(
        default_factory=GroupTopology, json_schema_extra={"default": {}}, description=GROUP_TOPOLOGY_DOC
    )
    dp_attention: Optional[bool] = Field(None, description=L.DP_ATTENTION_DOC)
    redundant_experts: Optional[int] = Field(None, ge=0, le=4096, description=L.REDUNDANT_EXPERTS_DOC)
    resources: Resources = _nested(Resources)
    node_selector: dict[QualifiedName, LabelValue] = Field(
        DEFAULT_NODE_SELECTOR,
        max_length=MAX_MAP_ENTRIES,
        description="Replaces the Blackwell default when set ({} for none).",
    )
    tolerations: list[Toleration] = Field(
        [Toleration.model_validate(t) for t in DEFAULT_TOLERATIONS],
        max_length=MAX_MAP_ENTRIES,
        description="Replaces the default GPU-taint toleration when set ([] for none).",
    )
    affinity: dict[str, Any] = Field({}, description="A Kubernetes Affinity.")
    env: list[EnvVar] = Field([], max_length=MAX_LIST_ITEMS)  # bounded: the API server budgets CEL cost
    args: list[str] = []
    shm_size: str = Field("32Gi", pattern=QUANTITY_PATTERN, description="Size limit of the memory-backed /dev/shm.")
    partition: int = Field(
        0,
        ge=0,
        description="Canary: on a change, only pods with ordinal >= partition get the new pod template "
        "(the StatefulSet partition); lower it to roll on, 0 rolls every pod.",
    )
    termination_grace_period_seconds: int = Field(
        120,
        ge=1,
        le=86400,
        description="Seconds a stopping pod gets: its preStop hook drains in-flight requests for all but the "
        "last 10 of them, then the engine is sent SIGTERM.",
    )
    startup_timeout_seconds: int = Field(
        1800,
        ge=10,
        le=86400,
        description="How long an engine may take to load the checkpoint and answer /health before the kubelet "
        "restarts it (the startup probe's budget, in 10 s periods).",
    )


class RouterSpec(_Model):
    replicas: int = Field(1, ge=0)
    scaling: Literal["operator", "external"] = Field(
        "operator",
        description="operator: replicas is the count, and the operator puts it back if changed. external: an HPA, "
        "KEDA or `kubectl scale` owns the workload's replicas; replicas is only the count it starts with.",
    )
    port: int = Field(8000, ge=1, le=65535)
    image: Optional[str] = Field(None, description="Router image (default: the engine image).")
    args: list[str] = []
    env: list[EnvVar] = Field([], max_length=MAX_LIST_ITEMS)  # bounded: the API server budgets CEL cost
    resources: Resources = _nested(Resources)


class TransferSpec(_Model):
    backend: Literal["nixl"] = "nixl"
    ucx_net_devices: str = Field(
        "", description="UCX_NET_DEVICES for the engines; set it on multi-NIC nodes or transfers hang."
    )
    bootstrap_port: int = Field(8998, ge=1, le=65535)
    bootstrap_timeout_seconds: int = Field(300, ge=1)
    transfer_timeout_seconds: int = Field(300, ge=1)
    env: list[EnvVar] = Field([], max_length=MAX_LIST_ITEMS, description="More UCX/NIXL environment.")


class MaxUnavailable(_Model):
    prefill: int = Field(1, ge=0)
    decode: int = Field(1, ge=0)


class RemediationSpec(_Model):
    enabled: bool = True
    dry_run: bool = False
    scrape_interval_seconds: float = Field(
        10, ge=0.1, description="How often every engine pod is scraped (fractions allowed, e.g. 0.5)."
    )
    detection_window_seconds: Optional[int] = Field(
        None,
        ge=1,
        description="How long nothing may move before a pod is wedged. Unset: derived so the engine's own "
        "deadlines act first (builtin: bootstrap + transfer timeout + 30 s, the longest PD "
        "deadline; sglang: 120 s, its inflight queue has none).",
    )
    transfer_failure_rate_threshold: float = Field(0.5, ge=0, le=1)
    max_unavailable: MaxUnavailable = _nested(MaxUnavailable)
    cooldown_seconds: int = Field(300, ge=0)
    pod_disruption_budget: bool = Field(
        True,
        description="A PodDisruptionBudget per engine role with maxUnavailable from maxUnavailable; turn off "
        "if you manage your own (two budgets on one pod make every eviction fail).",
    )
    capture_evidence: bool = True
    rollback: Literal["off", "suggest", "auto"] = Field(
        "suggest",
        description="When wedges follow a spec change: off; suggest (name the stable revision); auto "
        "(pin it: the children run it, the spec is never rewritten).",
    )


class CanarySpec(_Model):
    """The canary step of an engine rollout (docs/operations.md, "Rolling out engine changes")."""

    enabled: bool = Field(
        True,
        description="On a change to the engines (image, args, env, resources), move one pod "
        "of the changed role first and probe it before the rest roll.",
    )
    duration_seconds: int = Field(
        120,
        ge=1,
        le=3600,
        description="How long the probe sends requests (per engine probed: the canary and one stable pod).",
    )
    concurrency: int = Field(2, ge=1, le=64, description="Conversations the probe runs at once.")
    rounds: int = Field(32, ge=1, le=1000, description="Most rounds of one conversation before a new one starts.")
    growth_tokens: int = Field(
        96, ge=1, le=65536, description="Tokens each round adds (a tool call's result and the next turn)."
    )
    context_share: float = Field(
        0.5, gt=0, le=1, description="The share of the model's context the conversation grows to."
    )
    request_timeout_seconds: int = Field(
        30, ge=1, le=600, description="A probe request unanswered after this is stalled: the canary fails."
    )
    ready_timeout_seconds: int = Field(
        1800,
        ge=10,
        le=86400,
        description="How long the canary pod may take to run the new revision and be ready; then it fails.",
    )
    traffic_percent: int = Field(
        0,
        ge=0,
        le=50,
        description="Percent of its role's live requests each router sends the canary while it is probed "
        "(0: the probe's pinned requests alone). At most 50: the stable pods keep most of the traffic.",
    )
    max_ttft_ratio: float = Field(
        2.0, ge=1, description="Canary TTFT p99 at most this times the stable pod's (+ 50 ms)."
    )
    max_itl_ratio: float = Field(2.0, ge=1, description="Canary ITL p99 at most this times the stable pod's (+ 50 ms).")


class RolloutSpec(_Model):
    order: Literal["prefillFirst", "together"] = Field(
        "prefillFirst",
        description="prefillFirst: a change to the engines rolls prefill, and decode only once every prefill pod "
        "is updated and ready. together: both at once (faster; a full outage with one replica each).",
    )
    canary: CanarySpec = _nested(CanarySpec)


class NetworkPolicySpec(_Model):
    enabled: bool = Field(
        True,
        description="NetworkPolicies for engines (ingress from the router, the operator and their PD peers) "
        "and router (ingress from clients, egress to engines, DNS and the API server); on by "
        "default: engines take the PD secret's requests and admin calls.",
    )
    operator_namespace: Optional[str] = Field(
        None, max_length=63, description="Namespace of the operator's pods (default: the operator's own)."
    )
    operator_pod_labels: dict[QualifiedName, LabelValue] = Field(
        {"app.kubernetes.io/name": "dsv4-operator"},
        max_length=MAX_MAP_ENTRIES,
        description="Labels of the operator's pods (the chart's default).",
    )
    allow_from: list[dict[str, Any]] = Field(
        [], description="More NetworkPolicyPeers allowed to the engine and router HTTP ports (e.g. your Prometheus)."
    )
    clients: Optional[list[dict[str, Any]]] = Field(
        None,
        description="NetworkPolicyPeers allowed to the router's port, the clients (default: every pod of "
        "the deployment's namespace; [] admits only the operator and allowFrom).",
    )
    api_server_cidrs: list[str] = Field(
        ["0.0.0.0/0", "::/0"],
        max_length=MAX_LIST_ITEMS,
        description="Where the router may reach the Kubernetes API (TCP 443 and 6443) to discover engine pods; "
        "narrow it to your API server's addresses.",
    )
    extra_egress: list[dict[str, Any]] = Field(
        [],
        description="More NetworkPolicyEgressRules for engines and router (e.g. an OTLP collector); besides "
        "them, engines reach only their PD peers and DNS, the router only the engines, DNS and "
        "the API server.",
    )


class SecuritySpec(_Model):
    secret_name: Optional[str] = Field(
        None,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="Secret with keys admin-token, pd-secret and router-admin-token (default <name>-auth); the "
        "operator creates it when absent, with values derived from its operator key and the deployment's uid "
        "(HMAC-SHA256), and never changes it. An existing one is used only when owned by this deployment, or labelled "
        "app.kubernetes.io/managed-by=dsv4-operator and annotated serving.dsv4.dev/deployment=<name>; another "
        "deployment's Secret, one not given to this deployment, or one missing a key is reported (Degraded: "
        "SecretOfAnotherDeployment, SecretNotOwned, SecretUnusable).",
    )
    run_as_user: Optional[int] = Field(
        None,
        ge=1,
        description="UID of the engine and router containers (default: the image's; the builtin "
        "image runs as 10001). Set it for an SGLang image to run it non-root.",
    )
    ipc_lock: bool = Field(
        False,
        description="Add the IPC_LOCK capability to engines (RDMA memory registration where the runtime's "
        "memlock limit is too low); the pods then need Pod Security privileged (IPC_LOCK is in neither "
        "baseline nor restricted).",
    )
    network_policy: NetworkPolicySpec = _nested(NetworkPolicySpec)


class DSV4DeploymentSpec(_Model):
    model_config = ConfigDict(
        json_schema_extra=_rules(
            cel("self.engine.port != self.transfer.bootstrapPort", MSG_PORT_CLASH, ".transfer.bootstrapPort"),
            cel(
                f"self.engine.kind != 'sglang' || self.router.port != {SGLANG_ROUTER_METRICS_PORT}",
                MSG_ROUTER_PORT_CLASH,
                ".router.port",
            ),
            cel(
                "(self.prefill.nodesPerReplica == 1 && self.decode.nodesPerReplica == 1) || "
                f"(!(self.engine.port in [{GROUP_PORT}, {GROUP_PORT + 1}]) && "
                f"!(self.transfer.bootstrapPort in [{GROUP_PORT}, {GROUP_PORT + 1}]))",
                MSG_GROUP_PORT_CLASH,
                ".engine.port",
            ),
            L.SGLANG_REDUNDANT_RULE,
        )
    )

    model: ModelSpec
    engine: EngineSpec
    prefill: RoleSpec = _nested(RoleSpec)
    decode: RoleSpec = _nested(RoleSpec)
    router: RouterSpec = _nested(RouterSpec)
    transfer: TransferSpec = _nested(TransferSpec)
    remediation: RemediationSpec = _nested(RemediationSpec)
    rollout: RolloutSpec = _nested(RolloutSpec)
    security: SecuritySpec = _nested(SecuritySpec)
    planner: Optional[PlannerSpec] = Field(
        None,
        description="Settings of the roles with `scaling: planner` (defaults when absent); ignored by other roles.",
    )

    def role(self, role: str) -> RoleSpec:
        return {"prefill": self.prefill, "decode": self.decode}[role]

    def detection_window(self) -> float:
        """The watchdog's window. A stalled transfer that the engine fails by its own deadline
        must not become a restart first, so by default the window outlasts the longest PD
        deadline of a builtin engine (decode waits bootstrap + transfer). SGLang's prefill
        inflight queue has no deadline at all, so waiting for one would never act."""
        if self.remediation.detection_window_seconds is not None:
            return float(self.remediation.detection_window_seconds)
        if self.engine.kind == "builtin":
            t = self.transfer
            return float(t.bootstrap_timeout_seconds + t.transfer_timeout_seconds + DEADLINE_MARGIN_SECONDS)
        return float(SGLANG_DETECTION_WINDOW_SECONDS)

    def scaling_of(self, role: str) -> str:
        """How `role` (prefill, decode or router) is scaled: by the operator or from outside."""
        return self.router.scaling if role == "router" else self.role(role).scaling

    def replicas_from_workload(self, role: str) -> bool:
        """The workload's replicas are not the spec's: an autoscaler (external) or the planner sets them,
        and the operator's apply leaves the field out."""
        return self.scaling_of(role) in ("external", "planner")

    def planner_settings(self) -> PlannerSpec:
        return self.planner if self.planner is not None else PlannerSpec()

    def planned_roles(self) -> list[str]:
        """The engine roles whose count the planner sets."""
        return [role for role in ("prefill", "decode") if self.role(role).scaling == "planner"]


def parse_spec(raw: Any) -> DSV4DeploymentSpec:
    """Validate a CR's raw spec (raises pydantic.ValidationError)."""
    return DSV4DeploymentSpec.model_validate(raw if raw is not None else {})


def dump(model: BaseModel) -> dict[str, Any]:
    """The user-facing form of a model: camelCase, unset optionals left out."""
    return model.model_dump(by_alias=True, exclude_none=True, mode="json")


def spec_revision(spec: DSV4DeploymentSpec) -> str:
    """A short, stable hash of the spec (defaults applied), for status.revision."""
    canonical = json.dumps(dump(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]
