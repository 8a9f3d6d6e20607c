"""Pure builders: a DSV4Deployment spec -> the Kubernetes objects that run it.

Children of a DSV4Deployment `<name>` in its namespace:
  <name>-prefill  StatefulSet + headless Service   (engines, role prefill)
  <name>-decode   StatefulSet + headless Service   (engines, role decode)
  <name>-router   Deployment + Service             (the PD router)
  <name>-router   ServiceAccount + Role + RoleBinding (the router lists engine pods to find them)

Every child carries an ownerReference to the DSV4Deployment, so deleting the resource deletes
them (the API server's garbage collector does it; the operator needs no finalizer).
No I/O here: the handlers apply what these functions return.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

from dsv4_operator import groups as G
from dsv4_operator import spec as S
from dsv4_operator.engine_layout import layout_flags, layout_reasons
from dsv4_operator.quantity import QUANTITY_FIELDS, QUANTITY_MAPS, same_quantity
from dsv4_operator.spec import DSV4DeploymentSpec, EnvVar, RoleSpec
from dsv4_wire import (  # noqa: F401  (re-exported: the operator's modules read them from here)
    ADMIN_TOKEN_ENV,
    PD_SECRET_ENV,
    ANNOTATION_REVISION,
    APP,
    ENGINE_CONTAINER,
    ENGINE_ROLES,
    LABEL_COMPONENT,
    LABEL_ENGINE_KIND,
    LABEL_INSTANCE,
    LABEL_DEPLOYMENT,
    LABEL_DRAINING,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_ROLE,
    MANAGER,
    EngineFlags,
    Paths,
)
from dsv4_wire.flags import RouterFlags

GROUP_PORT = G.GROUP_PORT
SGLANG_BOOTSTRAP_ANNOTATION = "sglang.ai/bootstrap-port"  # where sgl-router's discovery reads it

ROUTER_CONTAINER = "router"
HTTP_PORT_NAME = "http"
BOOTSTRAP_PORT_NAME = "bootstrap"
SGLANG_ROUTER_METRICS_PORT = S.SGLANG_ROUTER_METRICS_PORT

# The longest CR name whose children stay valid: a StatefulSet's pods carry the label
# controller-revision-hash=<sts name>-<10 chars>, which must fit in 63 characters.
MAX_NAME_LENGTH = 52 - len("-prefill")
DNS1035_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
_DNS1035 = re.compile(DNS1035_PATTERN)


@dataclass(frozen=True)
class Owner:
    """The DSV4Deployment the children belong to."""

    name: str
    namespace: str
    uid: str


def child_name(name: str, role: str) -> str:
    return f"{name}-{role}"


def selector_labels(name: str, role: str) -> dict[str, str]:
    return {LABEL_NAME: APP, LABEL_INSTANCE: name, LABEL_ROLE: role}


def labels(name: str, role: str, spec: DSV4DeploymentSpec | None = None) -> dict[str, str]:
    out = {**selector_labels(name, role), LABEL_COMPONENT: role, LABEL_MANAGED_BY: MANAGER}
    if spec is not None and role in ENGINE_ROLES:
        out[LABEL_ENGINE_KIND] = spec.engine.kind
    return out


def unbuildable_reasons(name: str, spec: DSV4DeploymentSpec) -> list[str]:
    """What in a (schema-valid) resource the operator cannot turn into children."""
    reasons = []
    if not _DNS1035.match(name):
        reasons.append(
            f"name {name!r} must be a DNS-1035 label (lower case, starts with a letter): it names the Services"
        )
    if len(name) > MAX_NAME_LENGTH:
        reasons.append(
            f"name {name!r} is longer than {MAX_NAME_LENGTH} characters, too long for the StatefulSet pod labels"
        )
    # The CRD's CEL rules (spec.py) refuse the rest at admission; checked here too for a CRD
    # older than the operator, or an API server without CEL.
    vol = spec.model.volume
    if vol is not None:
        sources = [s for s in (vol.persistent_volume_claim, vol.host_path, vol.image) if s is not None]
        if len(sources) != 1:
            reasons.append(S.MSG_ONE_VOLUME_SOURCE)
    if spec.engine.port == spec.transfer.bootstrap_port:
        reasons.append(f"{S.MSG_PORT_CLASH} (both {spec.engine.port})")
    if spec.engine.kind == "sglang" and spec.router.port == SGLANG_ROUTER_METRICS_PORT:
        reasons.append(S.MSG_ROUTER_PORT_CLASH)
    if any(multi_node(spec, r) for r in ENGINE_ROLES) and {spec.engine.port, spec.transfer.bootstrap_port} & {
        GROUP_PORT,
        GROUP_PORT + 1,
    }:
        reasons.append(S.MSG_GROUP_PORT_CLASH)
    envs = [*spec.engine.env, *spec.transfer.env, *spec.router.env, *spec.prefill.env, *spec.decode.env]
    if any(e.value is not None and e.value_from is not None for e in envs):
        reasons.append(S.MSG_ENV_VALUE_AND_FROM)
    for t in [*spec.prefill.tolerations, *spec.decode.tolerations]:
        if t.operator == "Exists" and t.value:
            reasons.append(S.MSG_EXISTS_WITH_VALUE)
        if not t.key and t.operator != "Exists":
            reasons.append(S.MSG_EMPTY_KEY_NEEDS_EXISTS)
        if t.toleration_seconds is not None and t.effect != "NoExecute":
            reasons.append(S.MSG_SECONDS_NEED_NO_EXECUTE)
    reasons += layout_reasons(spec)
    return list(dict.fromkeys(reasons))


def owner_reference(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": S.API_VERSION,
        "kind": S.KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(owner: Owner, name: str, role: str, spec: DSV4DeploymentSpec, revision: str | None = None) -> dict:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels(owner.name, role, spec),
        "ownerReferences": [owner_reference(owner)],
    }
    if revision is not None:
        meta["annotations"] = {ANNOTATION_REVISION: revision}
    return meta


def merge_env(*groups: Iterable[EnvVar | dict[str, Any]]) -> list[dict[str, Any]]:
    """Env lists merged by name: a later group overrides an earlier one, first position kept."""
    merged: dict[str, dict[str, Any]] = {}
    for group in groups:
        for var in group:
            item = S.dump(var) if isinstance(var, EnvVar) else dict(var)
            merged[item["name"]] = item
    return list(merged.values())


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


# ---- The deployment's shared secrets ------------------------------------------------------------

ADMIN_TOKEN_KEY = "admin-token"  # keys of the deployment's auth Secret
PD_SECRET_KEY = "pd-secret"
# The router's own admin token: who may change the router's workers is not who may drain or
# abort on engines (and a router compromised gets no engine admin).
ROUTER_ADMIN_TOKEN_KEY = "router-admin-token"
AUTH_SECRET_KEYS = (ADMIN_TOKEN_KEY, PD_SECRET_KEY, ROUTER_ADMIN_TOKEN_KEY)


# On an auth Secret: the one deployment (by name) that may use it. The operator writes it on the
# Secrets it creates; a user's own Secret carries it to be used (auth_secret.usable_values). The
# same key as the evidence label that names a deployment.
ANNOTATION_SECRET_FOR = LABEL_DEPLOYMENT


def auth_secret_name(spec: DSV4DeploymentSpec, name: str) -> str:
    return spec.security.secret_name or child_name(name, "auth")


def auth_secret(spec: DSV4DeploymentSpec, owner: Owner, values: dict[str, str]) -> dict[str, Any]:
    """The Secret the operator creates when absent (values: one random string per key). Owned by
    the resource, so it goes with it; a Secret the user made is never replaced."""
    meta = _meta(owner, auth_secret_name(spec, owner.name), "auth", spec)
    meta["annotations"] = {ANNOTATION_SECRET_FOR: owner.name}
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": meta, "stringData": dict(values)}


def _secret_env(env: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": env, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def auth_env(spec: DSV4DeploymentSpec, name: str, admin_key: str = ADMIN_TOKEN_KEY) -> list[dict[str, Any]]:
    """The admin token (engines require it on /admin, /debug and /v1/loads; the operator sends
    it; the router has one of its own, ``admin_key``) and the PD secret (engine-to-engine calls
    and the router's internal requests), both from the deployment's Secret."""
    secret = auth_secret_name(spec, name)
    return [_secret_env(ADMIN_TOKEN_ENV, secret, admin_key), _secret_env(PD_SECRET_ENV, secret, PD_SECRET_KEY)]


# ---- Security contexts ---------------------------------------------------------------------------


def pod_security_context(spec: DSV4DeploymentSpec, builtin_image: bool) -> dict[str, Any]:
    """The pod-level part of PSA "restricted". runAsNonRoot is promised only where we know the
    image runs as a user (ours does, as 10001; SGLang's runs as root) or the spec names a UID."""
    out: dict[str, Any] = {"seccompProfile": {"type": "RuntimeDefault"}}
    if spec.security.run_as_user is not None:
        out.update(runAsNonRoot=True, runAsUser=spec.security.run_as_user)
    elif builtin_image:
        out["runAsNonRoot"] = True
    return out


def container_security_context(spec: DSV4DeploymentSpec, engine: bool) -> dict[str, Any]:
    """No privilege escalation and no capabilities: GPUs reach the container as device files
    (the NVIDIA device plugin / CDI), which needs none. IPC_LOCK only when asked (RDMA)."""
    caps: dict[str, Any] = {"drop": ["ALL"]}
    if engine and spec.security.ipc_lock:
        caps["add"] = ["IPC_LOCK"]
    return {"allowPrivilegeEscalation": False, "capabilities": caps}


def engine_env(spec: DSV4DeploymentSpec, role: str, name: Optional[str] = None) -> list[dict[str, Any]]:
    t = spec.transfer
    base: list[dict[str, Any]] = [
        _field_env("POD_NAME", "metadata.name"),
        _field_env("POD_NAMESPACE", "metadata.namespace"),
        _field_env("POD_IP", "status.podIP"),
    ]
    if name is not None:
        base += auth_env(spec, name)
    if t.ucx_net_devices:  # multi-NIC nodes: without it NIXL transfers can hang until timeouts
        base.append({"name": "UCX_NET_DEVICES", "value": t.ucx_net_devices})
    if role == "decode":  # do not keep a dead prefill's KV mapped after it restarts
        base.append({"name": "UCX_CUDA_IPC_CACHE", "value": "n"})
    if spec.engine.kind == "sglang":  # SGLang reads its PD deadlines from the environment
        base.append({"name": "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "value": str(t.bootstrap_timeout_seconds)})
        base.append({"name": "SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "value": str(t.transfer_timeout_seconds)})
    return merge_env(base, t.env, spec.engine.env, spec.role(role).env)


def engine_command(spec: DSV4DeploymentSpec, role: str, node: Optional[tuple[str, str]] = None) -> list[str]:
    """`node`: (node rank, node 0's address) of one pod of a multi-node group (nodesPerReplica > 1),
    each maybe a $(VAR) the kubelet expands; the engine then spans every GPU of the group."""
    m, e, t, r = spec.model, spec.engine, spec.transfer, spec.role(role)
    tp = max(1, r.gpus_per_pod) * r.nodes_per_replica if node is not None else r.gpus_per_pod
    group = [] if node is None else ["--nnodes", str(r.nodes_per_replica), "--node-rank", node[0]]
    group += [] if node is None else ["--dist-init-addr", f"{node[1]}:{GROUP_PORT}"]
    if e.kind == "builtin":
        F = EngineFlags
        # Listen on every address, advertise the pod's own: decode tells prefill where to reach
        # it, and 0.0.0.0 there would be prefill's own loopback. Kubernetes expands $(POD_IP).
        cmd = [
            "dsv4",
            "serve",
            F.MODEL,
            m.path,
            F.ROLE,
            role,
            F.HOST,
            "0.0.0.0",
            F.ADVERTISE_HOST,
            "$(POD_IP)",
            F.PORT,
            str(e.port),
            F.BOOTSTRAP_PORT,
            str(t.bootstrap_port),
            F.SERVED_MODEL_NAME,
            m.served,
            F.BOOTSTRAP_TIMEOUT,
            str(t.bootstrap_timeout_seconds),
            F.TRANSFER_TIMEOUT,
            str(t.transfer_timeout_seconds),
        ]
        if role == "decode":  # decode waits for its peer's bootstrap and then the transfer
            cmd += [F.WAITING_TIMEOUT, str(t.bootstrap_timeout_seconds + t.transfer_timeout_seconds)]
        if r.gpus_per_pod > 0:
            cmd += [F.DTYPE, "bfloat16"]
        if tp > 1:  # one engine spans every GPU of its pod (of its group's pods)
            cmd += [F.TP_SIZE, str(tp)]
        cmd += layout_flags(e.kind, r, tp)  # dpAttention, redundantExperts
        if e.kv_memory_fraction is not None:
            cmd += [F.KV_MEMORY_FRACTION, f"{e.kv_memory_fraction:g}"]
        if e.cuda_graph_max_bs is not None:
            cmd += [F.CUDA_GRAPH_MAX_BS, str(e.cuda_graph_max_bs)]
        cmd += group
    else:
        cmd = [
            "python3",
            "-m",
            "sglang.launch_server",
            "--model-path",
            m.path,
            "--served-model-name",
            m.served,
            "--host",
            "0.0.0.0",
            "--port",
            str(e.port),
            "--disaggregation-mode",
            role,
            "--disaggregation-transfer-backend",
            t.backend,
            "--enable-metrics",
        ]
        if role == "prefill":
            cmd += ["--disaggregation-bootstrap-port", str(t.bootstrap_port)]
        if tp > 1:
            cmd += ["--tp-size", str(tp)]
        cmd += layout_flags(e.kind, r, tp)
        cmd += group  # SGLang's own flags of the same names
    # User arguments last: for repeated flags the last one wins.
    return cmd + list(e.args) + list(r.args)


# sgl-router's selectors match labels by equality only, so "not draining" is spelled as a label
# SGLang engines start with (false) and the watchdog flips (true) to take a pod out.
NOT_DRAINING = "false"


def router_command(spec: DSV4DeploymentSpec, owner: Owner) -> list[str]:
    instance = f"{LABEL_INSTANCE}={owner.name}"
    serving = f"{LABEL_DRAINING}={NOT_DRAINING}"
    if spec.engine.kind == "builtin":
        R = RouterFlags
        cmd = [
            "dsv4",
            "router",
            R.HOST,
            "0.0.0.0",
            R.PORT,
            str(spec.router.port),
            R.DISCOVER_NAMESPACE,
            owner.namespace,
            R.SELECTOR,
            instance,
        ]
        for role in ENGINE_ROLES:  # only the pods of our StatefulSets, not any pod with our labels
            cmd += [R.OWNER, child_name(owner.name, role)]
        if router_reads_checkpoint(spec):  # renders and tokenizes as the engines do: placed by what each holds
            cmd += [R.TOKENIZER, spec.model.path]
    else:
        cmd = [
            "python3",
            "-m",
            "sglang_router.launch_router",
            "--pd-disaggregation",
            "--host",
            "0.0.0.0",
            "--port",
            str(spec.router.port),
            "--service-discovery",
            "--service-discovery-namespace",
            owner.namespace,
            "--service-discovery-port",
            str(spec.engine.port),
            "--prefill-selector",
            instance,
            f"{LABEL_ROLE}=prefill",
            serving,
            "--decode-selector",
            instance,
            f"{LABEL_ROLE}=decode",
            serving,
            "--prometheus-host",
            "0.0.0.0",
            "--prometheus-port",
            str(SGLANG_ROUTER_METRICS_PORT),
        ]
    return cmd + list(spec.router.args)


def _http_probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": HTTP_PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


STARTUP_PROBE_PERIOD = 10
DRAIN_RESERVE_SECONDS = 10  # of the grace period, left to the engine's own SIGTERM shutdown

# The preStop hook of a builtin engine: ask it to drain (it stops taking requests and turns
# unready, so the router and Services drop it), then wait until its queues are empty or the
# budget is spent. Python, because the engine image has it and no curl is promised.
_DRAIN_SCRIPT = """\
import json, os, time, urllib.request as u
base = 'http://127.0.0.1:{port}'
token = os.environ.get('{token_env}')
headers = {{'Authorization': 'Bearer ' + token}} if token else {{}}
deadline = time.monotonic() + {budget}
try:
    u.urlopen(u.Request(base + '{drain}', data=b'', headers=headers, method='POST'), timeout=5)
except Exception:
    pass
while time.monotonic() < deadline:
    try:
        queues = json.load(u.urlopen(u.Request(base + '{loads}', headers=headers), timeout=5)).get('queues', {{}})
        if not any(queues.values()):
            break
    except Exception:
        break
    time.sleep(1)
"""


def drain_budget_seconds(role: RoleSpec) -> int:
    return max(1, role.termination_grace_period_seconds - DRAIN_RESERVE_SECONDS)


def engine_lifecycle(spec: DSV4DeploymentSpec, role: str) -> dict[str, Any]:
    """preStop: drain before SIGTERM. SGLang has no drain endpoint: there the hook only waits a
    few seconds, for the router's pod watch to drop the terminating pod before it stops serving."""
    budget = drain_budget_seconds(spec.role(role))
    if spec.engine.kind != "builtin":
        return {"preStop": {"exec": {"command": ["sleep", str(min(budget, 15))]}}}
    script = _DRAIN_SCRIPT.format(
        port=spec.engine.port, token_env=ADMIN_TOKEN_ENV, budget=budget, drain=Paths.ADMIN_DRAIN, loads=Paths.LOADS
    )
    return {"preStop": {"exec": {"command": ["python3", "-c", script]}}}


def engine_probes(spec: DSV4DeploymentSpec, role: str = "prefill") -> dict[str, Any]:
    # SGLang has no /ready; its /health answers once the scheduler serves.
    ready = Paths.READY if spec.engine.kind == "builtin" else Paths.HEALTH
    startup_failures = -(-spec.role(role).startup_timeout_seconds // STARTUP_PROBE_PERIOD)
    return {
        # Loading a large checkpoint takes minutes: liveness applies only once /health answered.
        "startupProbe": _http_probe(Paths.HEALTH, STARTUP_PROBE_PERIOD, startup_failures),
        "livenessProbe": _http_probe(Paths.HEALTH, 10, 3),
        "readinessProbe": _http_probe(ready, 5, 3),
    }


# A router with no resources given: bounded, so one deployment's router cannot take a node's
# memory (issue 27). Any router.resources given replaces this whole.
ROUTER_DEFAULT_RESOURCES = {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"cpu": "4", "memory": "2Gi"}}


# Engines with no resources given: a floor to schedule on and a memory ceiling, so one tenant's
# engine cannot take a node's memory (issue 27); generous, since a checkpoint passes through host
# memory while it loads. Any resources given replace this whole (GPUs are added either way).
ENGINE_DEFAULT_RESOURCES = {"requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"memory": "256Gi"}}
# What a builtin engine writes on its read-only root file system: scratch, and $HOME's caches
# (Triton's compiled kernels, torch's and CUDA's JIT caches).
ENGINE_HOME = "/home/dsv4"
ENGINE_SCRATCH = (("tmp", "/tmp", "4Gi"), ("home", ENGINE_HOME, "8Gi"))


def _resources(
    res: S.Resources, gpus: int, default: Optional[Mapping[str, Mapping[str, str]]] = None
) -> dict[str, Any]:
    if default is not None and not res.limits and not res.requests:
        res = S.Resources(limits=dict(default.get("limits") or {}), requests=dict(default.get("requests") or {}))
    limits = dict(res.limits)
    requests = dict(res.requests)
    if gpus > 0:
        limits["nvidia.com/gpu"] = gpus
        requests["nvidia.com/gpu"] = gpus
    out: dict[str, Any] = {}
    if limits:
        out["limits"] = limits
    if requests:
        out["requests"] = requests
    return out


def _model_volume(spec: DSV4DeploymentSpec) -> tuple[list[dict], list[dict]]:
    vol = spec.model.volume
    if vol is None:
        return [], []
    if vol.persistent_volume_claim is not None:
        pvc = vol.persistent_volume_claim
        source: dict[str, Any] = {"persistentVolumeClaim": {"claimName": pvc.claim_name, "readOnly": pvc.read_only}}
        read_only = pvc.read_only
    elif vol.host_path is not None:
        source = {"hostPath": S.dump(vol.host_path)}
        read_only = True
    else:
        assert vol.image is not None
        source = {"image": S.dump(vol.image)}
        read_only = True  # image volumes are always read-only
    return (
        [{"name": "model", **source}],
        [{"name": "model", "mountPath": spec.model.mount_path, "readOnly": read_only}],
    )


def _engine_pod(
    spec: DSV4DeploymentSpec, owner: Owner, role: str, node: Optional[tuple[str, str]] = None
) -> dict[str, Any]:
    """`node`: see engine_command (a pod of a multi-node group; dsv4_operator.groups shapes the rest)."""
    r: RoleSpec = spec.role(role)
    ports = [{"name": HTTP_PORT_NAME, "containerPort": spec.engine.port, "protocol": "TCP"}]
    if role == "prefill":
        ports.append({"name": BOOTSTRAP_PORT_NAME, "containerPort": spec.transfer.bootstrap_port, "protocol": "TCP"})
    model_volumes, model_mounts = _model_volume(spec)
    container = {
        "name": ENGINE_CONTAINER,
        "image": spec.engine.image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": engine_command(spec, role, node),
        "ports": ports,
        "env": engine_env(spec, role, owner.name),
        "resources": _resources(r.resources, r.gpus_per_pod, ENGINE_DEFAULT_RESOURCES),
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, *model_mounts],
        **engine_probes(spec, role),
        "lifecycle": engine_lifecycle(spec, role),
        "securityContext": container_security_context(spec, engine=True),
    }
    builtin = spec.engine.kind == "builtin"
    scratch_volumes: list[dict[str, Any]] = []
    if builtin:  # our image writes only there; SGLang's writes all over its root, so it stays writable
        container["securityContext"]["readOnlyRootFilesystem"] = True
        container["volumeMounts"] += [{"name": n, "mountPath": path} for n, path, _ in ENGINE_SCRATCH]
        scratch_volumes = [{"name": n, "emptyDir": {"sizeLimit": size}} for n, _, size in ENGINE_SCRATCH]
        container["env"] = merge_env([{"name": "HOME", "value": ENGINE_HOME}], container["env"])
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(spec.engine.port),
        "prometheus.io/path": Paths.METRICS,
    }
    pod_labels = labels(owner.name, role, spec)
    if spec.engine.kind == "sglang":
        pod_labels[LABEL_DRAINING] = NOT_DRAINING  # see router_command
    if role == "prefill" and spec.engine.kind == "sglang":
        annotations[SGLANG_BOOTSTRAP_ANNOTATION] = str(spec.transfer.bootstrap_port)
    pod_spec: dict[str, Any] = {
        "containers": [container],
        # NCCL / NIXL use shared memory; the container default of 64Mi is far too small.
        "volumes": [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": r.shm_size}},
            *model_volumes,
            *scratch_volumes,
        ],
        "nodeSelector": dict(r.node_selector),
        "tolerations": [S.dump(t) for t in r.tolerations],
        "automountServiceAccountToken": False,  # engines never talk to the API server
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": r.termination_grace_period_seconds,
        "securityContext": pod_security_context(spec, builtin_image=spec.engine.kind == "builtin"),
    }
    if r.affinity:
        pod_spec["affinity"] = dict(r.affinity)
    return {"metadata": {"labels": pod_labels, "annotations": annotations}, "spec": pod_spec}


# A partition no replica count reaches: the StatefulSet keeps every pod on its current template.
HOLD_PARTITION = 100_000


def prefill_rolled_out(prefill: Mapping[str, Any] | None) -> bool:
    """Pure: the prefill StatefulSet (as the API server returned it) runs its latest template on
    every pod, all ready. A missing one counts as rolled out (nothing to wait for)."""
    if not prefill:
        return True
    spec, status = prefill.get("spec") or {}, prefill.get("status") or {}
    replicas = int(spec.get("replicas", 1))
    return (
        int(status.get("observedGeneration") or 0) >= int((prefill.get("metadata") or {}).get("generation") or 0)
        and int(status.get("updatedReplicas") or 0) >= replicas
        and int(status.get("readyReplicas") or 0) >= replicas
    )


def contains(live: Any, wanted: Any, quantity: bool = False) -> bool:
    """Pure: `live` has every field of `wanted` with the same value (the API server adds defaults,
    so equality would never hold); lists item by item, same length. Quantities (resources, an
    emptyDir's sizeLimit) compare by value: the server serves `4` as "4" and `1000m` as "1"."""
    if isinstance(wanted, dict):
        if not isinstance(live, dict):
            return False
        if quantity:  # resources.limits / requests: every value a quantity
            return all(live.get(k) == v or same_quantity(live.get(k), v) for k, v in wanted.items())
        return all(contains(live.get(k), v, quantity=k in QUANTITY_MAPS + QUANTITY_FIELDS) for k, v in wanted.items())
    if isinstance(wanted, list):
        return isinstance(live, list) and len(live) == len(wanted) and all(map(contains, live, wanted))
    return live == wanted or (quantity and same_quantity(live, wanted))


def workload_template(obj: Mapping[str, Any] | None) -> Any:
    """Pure: the pod template(s) of an engine workload: a StatefulSet's template, a
    LeaderWorkerSet's leaderWorkerTemplate."""
    spec = (obj or {}).get("spec") or {}
    return spec.get("leaderWorkerTemplate") if (obj or {}).get("kind") == G.LWS_KIND else spec.get("template")


def partition_of(obj: Mapping[str, Any] | None) -> Any:
    """Pure: the rollout partition of a StatefulSet or a LeaderWorkerSet (None when unset)."""
    spec = (obj or {}).get("spec") or {}
    if (obj or {}).get("kind") == G.LWS_KIND:
        return ((spec.get("rolloutStrategy") or {}).get("rollingUpdateConfiguration") or {}).get("partition")
    return ((spec.get("updateStrategy") or {}).get("rollingUpdate") or {}).get("partition")


def decode_held(
    spec: DSV4DeploymentSpec,
    prefill_ready: bool,
    live_decode: Mapping[str, Any] | None,
    wanted_decode: Mapping[str, Any],
) -> bool:
    """PD-aware order (docs/operations.md, Rollouts): decode takes a new pod template only once
    prefill rolled out. Held while prefill is not rolled out and decode has a change to take:
    its template differs from the wanted one, or its pods (groups) are not all on its latest template."""
    if spec.rollout.order != "prefillFirst" or prefill_ready or not live_decode:
        return False
    status = live_decode.get("status") or {}
    if live_decode.get("kind") == G.LWS_KIND:
        behind = int(status.get("updatedReplicas") or 0) < int(status.get("replicas") or 0)
    else:
        behind = status.get("currentRevision") != status.get("updateRevision")
    return behind or not contains(workload_template(live_decode), workload_template(wanted_decode))


def engine_statefulset(
    spec: DSV4DeploymentSpec, owner: Owner, role: str, revision: str | None = None, hold: bool = False
) -> dict:
    """`hold`: keep every pod on its current template (partition past any ordinal)."""
    name = child_name(owner.name, role)
    partition = HOLD_PARTITION if hold else spec.role(role).partition
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(owner, name, role, spec, revision),
        "spec": {
            "serviceName": name,
            **_replicas(spec, role),
            # Engines are interchangeable: start (and load models) in parallel, not one by one.
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"partition": partition}},
            "selector": {"matchLabels": selector_labels(owner.name, role)},
            "template": (
                leader_template(spec, owner, role) if multi_node(spec, role) else _engine_pod(spec, owner, role)
            ),
        },
    }


def multi_node(spec: DSV4DeploymentSpec, role: str) -> bool:
    return spec.role(role).nodes_per_replica > 1


def leader_template(spec: DSV4DeploymentSpec, owner: Owner, role: str) -> dict[str, Any]:
    """A multi-node role's pod template for its leaders (node 0), carrying its workers' template
    (dsv4_operator.groups)."""
    worker = G.worker_template(_engine_pod(spec, owner, role, (G.NODE_RANK_REF, G.LEADER_ADDRESS_REF)), spec, role)
    return G.leader_template(_engine_pod(spec, owner, role, ("0", G.LEADER_SELF_ADDRESS)), worker, spec, role)


def engine_workload(
    spec: DSV4DeploymentSpec,
    owner: Owner,
    role: str,
    revision: str | None = None,
    hold: bool = False,
    lws: bool = False,
) -> dict:
    """The workload of one engine role: its StatefulSet, or (a multi-node role on a cluster with
    LeaderWorkerSet, `lws`) its LeaderWorkerSet, made from the same leader StatefulSet."""
    sts = engine_statefulset(spec, owner, role, revision, hold)
    return G.leaderworkerset(sts, spec, role) if lws and multi_node(spec, role) else sts


def workload_kind(spec: DSV4DeploymentSpec, role: str, lws: bool) -> tuple[str, str]:
    """(apiVersion, kind) of engine_workload's object for this role."""
    return (G.LWS_API_VERSION, G.LWS_KIND) if lws and multi_node(spec, role) else ("apps/v1", "StatefulSet")


def replaced_workloads(spec: DSV4DeploymentSpec, owner: Owner, lws: bool) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of an engine role's workload of the other kind, to delete before
    this one is applied: a LeaderWorkerSet makes its own StatefulSet of the same name, which an
    operator's StatefulSet left behind would fight (and the other way round). Only when the
    LeaderWorkerSet API is there to have made one."""
    if not lws:
        return []
    out = []
    for role in ENGINE_ROLES:
        name = child_name(owner.name, role)
        out.append(
            ("apps/v1", "StatefulSet", name) if multi_node(spec, role) else (G.LWS_API_VERSION, G.LWS_KIND, name)
        )
    return out


SCALE_MANAGER = f"{MANAGER}-scale"  # the field manager that hands replicas over to an autoscaler


def initial_replicas(spec: DSV4DeploymentSpec, role: str) -> int:
    """The count a workload starts with; a planned role's within the planner's bounds."""
    if role == "router":
        return spec.router.replicas
    replicas = spec.role(role).replicas
    if spec.role(role).scaling == "planner":
        bounds = getattr(spec.planner_settings(), role)
        replicas = min(max(replicas, bounds.min_replicas), bounds.max_replicas)
    return replicas


def _replicas(spec: DSV4DeploymentSpec, role: str) -> dict[str, int]:
    """replicas is in the applied config only when the operator owns it: server-side apply then
    never touches what an HPA, KEDA or `kubectl scale` set (see scale_handover)."""
    if spec.replicas_from_workload(role):
        return {}
    return {"replicas": initial_replicas(spec, role)}


def scale_handover(
    owner: Owner, role: str, replicas: int, kind: tuple[str, str] = ("apps/v1", "StatefulSet")
) -> dict[str, Any]:
    """The replicas of a workload alone, applied by SCALE_MANAGER, for a role scaled from outside:
    applied before the operator's own apply stops carrying replicas, it keeps the field (shared
    ownership) instead of letting it fall back to 1; after a create, it sets the starting
    count. Whoever scales next (HPA, kubectl scale) takes the field over."""
    api_version, kind = ("apps/v1", "Deployment") if role == "router" else kind
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {"name": child_name(owner.name, role), "namespace": owner.namespace},
        "spec": {"replicas": replicas},
    }


def engine_service(spec: DSV4DeploymentSpec, owner: Owner, role: str) -> dict:
    name = child_name(owner.name, role)
    ports = [{"name": HTTP_PORT_NAME, "port": spec.engine.port, "targetPort": HTTP_PORT_NAME, "protocol": "TCP"}]
    if role == "prefill":
        ports.append(
            {
                "name": BOOTSTRAP_PORT_NAME,
                "port": spec.transfer.bootstrap_port,
                "targetPort": BOOTSTRAP_PORT_NAME,
                "protocol": "TCP",
            }
        )
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, name, role, spec),
        "spec": {
            "clusterIP": "None",  # headless: stable per-pod DNS names for the StatefulSet
            "publishNotReadyAddresses": True,
            "selector": selector_labels(owner.name, role),
            "ports": ports,
        },
    }


def router_reads_checkpoint(spec: DSV4DeploymentSpec) -> bool:
    """Whether the builtin router mounts the checkpoint and tokenizes prompts with it (to place
    chat and text prompts by what each engine holds, not by affinity): when the model comes from
    an image volume (pulled on whatever node a router pod lands; a PersistentVolumeClaim may be
    ReadWriteOnce and a hostPath on one node only), the router runs the engine image (it holds
    the engine's renderer), and the engines render with the checkpoint's own template (no
    --chat-template file the router could not see)."""
    vol = spec.model.volume
    return (
        spec.engine.kind == "builtin"
        and vol is not None
        and vol.image is not None
        and not spec.router.image
        and EngineFlags.CHAT_TEMPLATE not in spec.engine.args
    )


def router_deployment(spec: DSV4DeploymentSpec, owner: Owner, revision: str | None = None) -> dict:
    name = child_name(owner.name, "router")
    builtin = spec.engine.kind == "builtin"
    ports = [{"name": HTTP_PORT_NAME, "containerPort": spec.router.port, "protocol": "TCP"}]
    if not builtin:
        ports.append({"name": "metrics", "containerPort": SGLANG_ROUTER_METRICS_PORT, "protocol": "TCP"})
    live, ready = (Paths.HEALTH, Paths.READY) if builtin else ("/liveness", "/readiness")
    container = {
        "name": ROUTER_CONTAINER,
        "image": spec.router.image or spec.engine.image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": router_command(spec, owner),
        "ports": ports,
        "env": merge_env(
            [_field_env("POD_NAMESPACE", "metadata.namespace"), *auth_env(spec, owner.name, ROUTER_ADMIN_TOKEN_KEY)],
            spec.router.env,
        ),
        "resources": _resources(spec.router.resources, 0) or dict(ROUTER_DEFAULT_RESOURCES),
        # Our router writes nothing but /tmp (an emptyDir): its root file system is read-only.
        "securityContext": {
            **container_security_context(spec, engine=False),
            **({"readOnlyRootFilesystem": True} if builtin else {}),
        },
        "livenessProbe": _http_probe(live, 10, 3),
        "readinessProbe": _http_probe(ready, 5, 3),
    }
    volumes = [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]
    if builtin:
        container["volumeMounts"] = [{"name": "tmp", "mountPath": "/tmp"}]
        if router_reads_checkpoint(spec):
            model_volumes, model_mounts = _model_volume(spec)
            volumes += model_volumes
            container["volumeMounts"] += model_mounts
    metrics_port = spec.router.port if builtin else SGLANG_ROUTER_METRICS_PORT
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(owner, name, "router", spec, revision),
        "spec": {
            **_replicas(spec, "router"),
            "selector": {"matchLabels": selector_labels(owner.name, "router")},
            # Never drop below the desired routers during an update.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {
                    "labels": labels(owner.name, "router", spec),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(metrics_port),
                        "prometheus.io/path": Paths.METRICS,
                    },
                },
                "spec": {
                    "serviceAccountName": name,
                    "containers": [container],
                    "enableServiceLinks": False,
                    "securityContext": pod_security_context(spec, builtin_image=builtin),
                    **({"volumes": volumes} if builtin else {}),
                },
            },
        },
    }


def router_service(spec: DSV4DeploymentSpec, owner: Owner) -> dict:
    name = child_name(owner.name, "router")
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, name, "router", spec),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(owner.name, "router"),
            "ports": [
                {"name": HTTP_PORT_NAME, "port": spec.router.port, "targetPort": HTTP_PORT_NAME, "protocol": "TCP"}
            ],
        },
    }


def engine_disruption_budget(spec: DSV4DeploymentSpec, owner: Owner, role: str) -> dict:
    """Voluntary disruptions (node drains, the watchdog's evictions) take at most maxUnavailable
    pods of a role at once. Pods that are not Ready may always be evicted: a wedged or crashing
    pod must not hold a node drain (or its own restart) hostage."""
    name = child_name(owner.name, role)
    # A multi-node role's budget counts whole groups: every pod of a broken group is unready
    # together (the engine fails as one, see dsv4_operator.groups), so maxUnavailable groups are
    # maxUnavailable x nodesPerReplica pods. One budget over the role's pods, never a second one.
    limit = getattr(spec.remediation.max_unavailable, role) * spec.role(role).nodes_per_replica
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(owner, name, role, spec),
        "spec": {
            "maxUnavailable": limit,
            "selector": {"matchLabels": selector_labels(owner.name, role)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


# DNS wherever the cluster serves it (kube-dns pods, NodeLocal DNSCache on a link-local address).
DNS_EGRESS = {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}
API_SERVER_PORTS = (443, 6443)  # the kubernetes Service's port, and the API server's own


def _operator_peer(spec: DSV4DeploymentSpec, operator_namespace: Optional[str]) -> dict[str, Any]:
    np = spec.security.network_policy
    namespace = np.operator_namespace or operator_namespace
    return {
        "podSelector": {"matchLabels": dict(np.operator_pod_labels)},
        "namespaceSelector": ({"matchLabels": {"kubernetes.io/metadata.name": namespace}} if namespace else {}),
    }


def _engines_selector(owner: Owner) -> dict[str, Any]:
    return {
        "matchLabels": {LABEL_NAME: APP, LABEL_INSTANCE: owner.name},
        "matchExpressions": [{"key": LABEL_ROLE, "operator": "In", "values": list(ENGINE_ROLES)}],
    }


def engine_network_policy(spec: DSV4DeploymentSpec, owner: Owner, operator_namespace: Optional[str] = None) -> dict:
    """Ingress to the engine pods from: the router (HTTP port), the operator (HTTP port: scrape,
    drain, abort), the deployment's other engines (every port: NIXL/UCX over TCP picks its
    own), and `allowFrom` (HTTP port). Egress to: the deployment's other engines (every port),
    DNS, and `extraEgress`: an engine has no reason to call anything else."""
    np = spec.security.network_policy
    http = [{"port": spec.engine.port, "protocol": "TCP"}]
    engines = _engines_selector(owner)
    ingress = [
        {
            "from": [
                {"podSelector": {"matchLabels": selector_labels(owner.name, "router")}},
                _operator_peer(spec, operator_namespace),
            ],
            "ports": http,
        },
        {"from": [{"podSelector": engines}]},
    ]
    if np.allow_from:
        ingress.append({"from": [dict(p) for p in np.allow_from], "ports": http})
    egress = [{"to": [{"podSelector": engines}]}, dict(DNS_EGRESS), *(dict(r) for r in np.extra_egress)]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(owner, child_name(owner.name, "engines"), "engines", spec),
        "spec": {"podSelector": engines, "policyTypes": ["Ingress", "Egress"], "ingress": ingress, "egress": egress},
    }


def router_network_policy(spec: DSV4DeploymentSpec, owner: Owner, operator_namespace: Optional[str] = None) -> dict:
    """Ingress to the router pods on its port from: the clients (`clients`; default every pod of
    the namespace), the operator (canary probes) and `allowFrom`. Egress to: the engines' HTTP
    port, DNS, the Kubernetes API (`apiServerCidrs`, for discovery) and `extraEgress`."""
    np = spec.security.network_policy
    port = [{"port": spec.router.port, "protocol": "TCP"}]
    clients = [{"podSelector": {}}] if np.clients is None else [dict(p) for p in np.clients]
    peers = [*clients, _operator_peer(spec, operator_namespace), *(dict(p) for p in np.allow_from)]
    egress = [
        {"to": [{"podSelector": _engines_selector(owner)}], "ports": [{"port": spec.engine.port, "protocol": "TCP"}]},
        dict(DNS_EGRESS),
        {
            "to": [{"ipBlock": {"cidr": c}} for c in np.api_server_cidrs],
            "ports": [{"port": p, "protocol": "TCP"} for p in API_SERVER_PORTS],
        },
        *(dict(r) for r in np.extra_egress),
    ]
    if spec.engine.kind != "builtin":  # sgl-router's metrics port, for the same scrapers as ours
        port.append({"port": SGLANG_ROUTER_METRICS_PORT, "protocol": "TCP"})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(owner, child_name(owner.name, "router"), "router", spec),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(owner.name, "router")},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": peers, "ports": port}],
            "egress": egress,
        },
    }


def router_rbac(spec: DSV4DeploymentSpec, owner: Owner) -> list[dict]:
    """The router discovers engine pods by label: it may read pods in its own namespace."""
    name = child_name(owner.name, "router")
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(owner, name, "router", spec)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta(owner, name, "router", spec),
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(owner, name, "router", spec),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
        },
    ]


def absent_children(spec: DSV4DeploymentSpec, owner: Owner) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of the optional children this spec turns off: server-side
    apply never removes an object, so the handlers delete these (absent already is fine)."""
    out = []
    if not spec.remediation.pod_disruption_budget:
        out += [("policy/v1", "PodDisruptionBudget", child_name(owner.name, role)) for role in ENGINE_ROLES]
    if not spec.security.network_policy.enabled:
        out += [("networking.k8s.io/v1", "NetworkPolicy", child_name(owner.name, c)) for c in ("engines", "router")]
    return out


def build_children(
    spec: DSV4DeploymentSpec,
    owner: Owner,
    operator_namespace: Optional[str] = None,
    hold_decode: bool = False,
    lws: bool = False,
) -> list[dict[str, Any]]:
    """Every object a DSV4Deployment owns, in the order to apply them (RBAC and Services
    before the workloads that use them). The auth Secret is not among them: it is created
    once, never applied (see auth_secret.ensure_auth_secret). `lws`: the cluster serves the
    LeaderWorkerSet API, so multi-node roles are LeaderWorkerSets (dsv4_operator.groups)."""
    revision = S.spec_revision(spec)
    return [
        *router_rbac(spec, owner),
        *(
            [
                engine_network_policy(spec, owner, operator_namespace),
                router_network_policy(spec, owner, operator_namespace),
            ]
            if spec.security.network_policy.enabled
            else []
        ),
        engine_service(spec, owner, "prefill"),
        engine_service(spec, owner, "decode"),
        router_service(spec, owner),
        *(
            [engine_disruption_budget(spec, owner, role) for role in ENGINE_ROLES]
            if spec.remediation.pod_disruption_budget
            else []
        ),
        engine_workload(spec, owner, "prefill", revision, lws=lws),
        engine_workload(spec, owner, "decode", revision, hold=hold_decode, lws=lws),
        router_deployment(spec, owner, revision),
    ]
