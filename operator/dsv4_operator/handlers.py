"""kopf handlers for DSV4Deployment: thin shells around `manifests` and `status`.

- create / update / resume: validate the spec, server-side-apply every child, write the status.
- events of the children (StatefulSets, Deployment): recompute the owner's status; re-apply the
  children when one of them was deleted by hand.
- a spec the operator cannot act on becomes Degraded=True (reason InvalidSpec) and a Warning
  Event, once per generation: no exception, so no retry loop and no crash loop.
Deleting a DSV4Deployment needs no handler: every child has an ownerReference to it and the
API server's garbage collector removes them.

- a daemon per DSV4Deployment runs its wedge watchdog (dsv4_operator.remediation). kopf keeps
  a finalizer on resources with daemons, to stop the daemon before the resource goes.

All handlers live in `registry`, which `dsv4_operator.main` runs.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import time
from typing import Any, Callable, Iterable, Mapping, Optional

import kopf
from pydantic import ValidationError

from dsv4_operator import auth_secret, spec as S
from dsv4_operator.auth_secret import AuthSecretRefused, ensure_auth_secret
from dsv4_operator.drift import describe_removals, foreign_entry_removals, foreign_label_removals
from dsv4_operator.fight import FightTracker, other_manager
from dsv4_operator.kube import ApiError, KubeApi, connection_info, load_configuration, path_of
from dsv4_operator.manifests import (
    ADMIN_TOKEN_KEY,
    APP,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_ROLE,
    MANAGER,
    HOLD_PARTITION,
    SCALE_MANAGER,
    Owner,
    absent_children,
    build_children,
    child_name,
    decode_held,
    engine_statefulset,
    initial_replicas,
    prefill_rolled_out,
    scale_handover,
    unbuildable_reasons,
)
from dsv4_operator.canary import plan as canary_plan
from dsv4_operator.pinning import pinned_spec
from dsv4_operator.pod_creation import CREATION_FAILURES, FAILED_CREATE, creation_failure
from dsv4_operator.remediation.daemon import DeploymentWatchdog
from dsv4_operator.watchdog.pods import engine_pod_index_key, pod_snapshot
from dsv4_operator.status import (
    APPLY_REFUSAL_REASONS,
    ROLES,
    ApplyRefusal,
    ChildObservation,
    compute_status,
    observe,
    remediation_counts,
    status_changed,
)
from dsv4_operator.telemetry import OperatorMetrics
from dsv4_operator.tenant_policy import TenantPolicy, policy_violations
from dsv4_wire import ANNOTATION_PINNED_REVISION

registry = kopf.OperatorRegistry()
# What a DSV4Deployment may ask for on this cluster (the chart's tenantPolicy); read once.
TENANT_POLICY = TenantPolicy.from_env()

CR = (S.GROUP, S.VERSION, S.PLURAL)
CHILD_LABELS = {LABEL_NAME: APP, LABEL_MANAGED_BY: MANAGER}
# Normal Events go through kopf.event: kopf.info obeys settings.posting.level, which main sets to
# WARNING so that kopf's own per-handler "succeeded" lines do not become Events.
STATUS_WRITE_ATTEMPTS = 5


APPLY_RETRY_BASE_SECONDS = 10
APPLY_RETRY_CAP_SECONDS = 300


def retry_delay(retry: int, base: float = APPLY_RETRY_BASE_SECONDS, cap: float = APPLY_RETRY_CAP_SECONDS) -> float:
    """Pure: the wait before retry number `retry` + 1 of a failed apply: doubling, capped. A 403
    (RBAC, an admission plugin) or a 5xx may be put right by an administrator, so it is retried,
    but not at a fixed pace forever."""
    return float(min(cap, base * 2 ** min(retry, 16)))


def describe_apply_error(e: ApiError) -> str:
    """Pure: the status message of a failed apply; a 403 says what to grant."""
    if e.status == 403:
        return (
            f"{e}; the operator's ServiceAccount lacks a permission the cluster requires "
            "(see docs/operations.md, RBAC and Supported clusters); retried with back-off"
        )
    return str(e)


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def describe_validation_error(err: ValidationError) -> str:
    """One line per problem, with the user-facing field path."""
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "spec"
        lines.append(f"spec.{where}: {e['msg']}")
    return "; ".join(lines)


def check_spec(name: str, raw_spec: Any) -> tuple[Optional[S.DSV4DeploymentSpec], Optional[str]]:
    """(spec, None) when the operator can act on it, else (None, why not)."""
    try:
        spec = S.parse_spec(dict(raw_spec or {}))
    except ValidationError as e:
        return None, describe_validation_error(e)
    reasons = unbuildable_reasons(name, spec) + policy_violations(spec, TENANT_POLICY)
    if reasons:
        return None, "; ".join(reasons)
    return spec, None


def effective_spec(
    name: str, raw_spec: Any, annotations: Optional[Mapping[str, str]], generation: int
) -> tuple[Optional[S.DSV4DeploymentSpec], Optional[str], Optional[str]]:
    """(spec to build from, why not, pinned revision): the user's spec, or a pinned revision's
    (pinned_spec) when one applies and can be acted on."""
    spec, problem = check_spec(name, raw_spec)
    if spec is None:
        return None, problem, None
    pinned_raw, revision = pinned_spec(annotations, generation, raw_spec)
    if pinned_raw is not None:
        pinned, _ = check_spec(name, pinned_raw)
        if pinned is not None:
            return pinned, None, revision
    spec, reverted = canary_plan.effective(name, spec, raw_spec, annotations, HOLD_PARTITION)  # the canary gate
    return spec, None, reverted


def _metrics(memo: kopf.Memo) -> OperatorMetrics:
    if getattr(memo, "metrics", None) is None:
        memo.metrics = OperatorMetrics()
    return memo.metrics


def _api(memo: kopf.Memo) -> KubeApi:
    api = getattr(memo, "api", None)
    if api is None:
        raise kopf.TemporaryError("not logged in to the API server yet", delay=2)
    return api


def _children(namespace: str, name: str, *indices: Any) -> list[ChildObservation]:
    found: list[ChildObservation] = []
    for index in indices:
        found.extend(obs for obs in index.get((namespace, name), []) if obs is not None)
    return found


def _carried_apply_error(previous: dict[str, Any], observed_generation: Optional[int]) -> Optional[str]:
    """An apply failure stands until the operator applies again (a new generation or a retry)."""
    for cond in previous.get("conditions") or []:
        if (
            cond.get("type") == "Degraded"
            and cond.get("reason") in APPLY_REFUSAL_REASONS
            and cond.get("observedGeneration") == observed_generation
        ):
            return ApplyRefusal(cond.get("message") or "apply failed", cond["reason"])
    return None


IMAGE_VOLUME_UNSUPPORTED = "ImageVolumeUnsupported"


async def image_volume_refusal(api: KubeApi, spec: S.DSV4DeploymentSpec, owner: Owner) -> Optional[ApplyRefusal]:
    """With `model.volume.image`: whether this cluster keeps an image volume. Where the ImageVolume
    feature gate is off (the default through 1.33; the field does not exist before 1.31) the API
    server drops the volume and its mounts without a word, and engines would start without their
    checkpoint. Asked by a dry-run apply of the prefill StatefulSet: nothing is written."""
    manifest = engine_statefulset(spec, owner, "prefill", S.spec_revision(spec))
    answer = await api.request(
        "PATCH",
        path_of(manifest),
        body=manifest,
        content_type="application/apply-patch+yaml",
        query=[("fieldManager", api.field_manager), ("force", "true"), ("dryRun", "All")],
    )
    volumes = (((answer or {}).get("spec") or {}).get("template") or {}).get("spec", {}).get("volumes") or []
    if any(v.get("name") == "model" and "image" in v for v in volumes):
        return None
    try:
        version = await api.request("GET", "/version")
        server = f"{version.get('major')}.{version.get('minor')}"
    except ApiError:
        server = "unknown"
    return ApplyRefusal(
        f"model.volume.image needs image volumes, which this cluster (Kubernetes {server}) drops: they need "
        "1.31 or later with the ImageVolume feature gate on (off by default through 1.33). Nothing was applied: "
        "use a persistentVolumeClaim or hostPath model volume, or enable the gate and edit the resource",
        IMAGE_VOLUME_UNSUPPORTED,
    )


async def refresh_status(
    api: KubeApi,
    metrics: OperatorMetrics,
    namespace: str,
    name: str,
    children: Callable[[], Iterable[ChildObservation]],
    *,
    observed_generation: Optional[int] = None,
    apply_error: Optional[str] = None,
    revision: Optional[str] = None,
    acted: bool = False,
) -> Optional[dict[str, Any]]:
    """Read the resource, compute its status from the children, write it if it changed.

    `acted` marks a call from the reconciler, which speaks for `observed_generation`, its
    apply error and revision; other callers carry those over from the stored status. The write
    names the resourceVersion it read, so a concurrent writer (the reconciler, the watchdog)
    makes it re-read instead of being overwritten. `children` is read again on every attempt:
    the indexes move on while we wait for the API server."""
    computed: list[tuple[dict[str, Any], bool]] = []

    def status_patch(cr: dict) -> Optional[dict]:
        computed.clear()
        if cr["metadata"].get("deletionTimestamp"):
            return None
        meta = cr["metadata"]
        previous = cr.get("status") or {}
        spec, spec_error, pinned = effective_spec(
            name, cr.get("spec"), meta.get("annotations"), int(meta.get("generation") or 0)
        )
        observed = observed_generation if acted else previous.get("observedGeneration")
        kids = list(children())
        new = compute_status(
            spec=spec,
            spec_error=spec_error,
            generation=int(meta.get("generation") or 0),
            observed_generation=observed,
            children=kids,
            previous=previous,
            now=now_rfc3339(),
            creation_failures=CREATION_FAILURES.standing(namespace, kids),
            apply_error=apply_error if acted else _carried_apply_error(previous, observed),
            revision=revision if acted else None,
            remediation_counts=remediation_counts(meta.get("annotations")),
            pinned_revision=pinned,
            canary=canary_plan.CanaryRecord.from_annotations(meta.get("annotations")),
            canary_failed=canary_plan.failed_for(meta.get("annotations"), cr.get("spec")),
        )
        changed = status_changed(previous, new)
        computed.append((new, changed))
        return {"status": new} if changed else None

    try:
        written = await api.patch_with_retry(
            S.API_VERSION, S.KIND, namespace, name, status_patch, subresource="status", attempts=STATUS_WRITE_ATTEMPTS
        )
    except ApiError as e:
        if e.status == 409:
            raise kopf.TemporaryError(f"status of {namespace}/{name} kept changing under us", delay=1) from None
        raise
    if written is None or not computed:
        return None  # gone, or being deleted
    new, changed = computed[0]
    if changed:
        metrics.status_writes.inc()
    return new


def operator_namespace() -> Optional[str]:
    """Where the operator runs (the chart sets POD_NAMESPACE): the NetworkPolicy admits it."""
    return os.environ.get("POD_NAMESPACE") or None


async def deployment_admin_token(api: KubeApi, namespace: str, name: str) -> Optional[str]:
    """The admin token of a deployment, for the operator's own calls to its engines (the watchdog's
    drain and abort). None when the resource is gone or its spec cannot be acted on."""
    cr = await api.get(S.API_VERSION, S.KIND, namespace, name)
    if cr is None:
        return None
    spec, _ = check_spec(name, cr.get("spec"))
    if spec is None:
        return None
    values = await ensure_auth_secret(api, spec, Owner(name, namespace, cr["metadata"]["uid"]))
    return values.get(ADMIN_TOKEN_KEY)


async def hand_over_replicas(api: KubeApi, owner: Owner, role: str, replicas: int) -> None:
    """Apply a workload's replicas alone as SCALE_MANAGER (see manifests.scale_handover). Not
    forced: if an autoscaler already set another value, it owns the field, as it should."""
    manifest = scale_handover(owner, role, replicas)
    try:
        await api.request(
            "PATCH",
            path_of(manifest),
            body=manifest,
            content_type="application/apply-patch+yaml",
            query=[("fieldManager", SCALE_MANAGER)],
        )
    except ApiError as e:
        if e.status != 409:
            raise


async def apply_children(
    api: KubeApi,
    metrics: OperatorMetrics,
    spec: S.DSV4DeploymentSpec,
    owner: Owner,
    existing_replicas: Optional[dict[str, int]] = None,
    seen: Optional[dict] = None,
) -> list[dict[str, Any]]:
    """Apply every child. `existing_replicas`: role -> replicas of the workloads that exist now
    (from the index), for the roles scaled from outside; `seen`: where to note the generations
    our writes gave the workloads (see _child_changed)."""
    await ensure_auth_secret(api, spec, owner)
    existing = existing_replicas or {}
    external = [role for role in ROLES if spec.replicas_from_workload(role)]
    for role in external:  # before our apply stops carrying replicas, so the count stays
        if role in existing:
            await hand_over_replicas(api, owner, role, existing[role])
    applied = []
    prefill: Optional[dict[str, Any]] = None
    prefill_name, decode_name = child_name(owner.name, "prefill"), child_name(owner.name, "decode")
    for manifest in build_children(spec, owner, operator_namespace()):
        is_sts = manifest["kind"] == "StatefulSet"
        if (
            is_sts
            and manifest["metadata"]["name"] == decode_name
            and await _hold_decode(api, spec, owner, manifest, prefill or {})
        ):
            manifest = engine_statefulset(spec, owner, "decode", S.spec_revision(spec), hold=True)
        result = await apply_repairing(api, manifest)
        _remember_generation(seen, result)
        if is_sts and manifest["metadata"]["name"] == prefill_name:
            prefill = result
        applied.append(result)
        metrics.applied.labels(manifest["kind"]).inc()
    for role in external:  # just created (at the default of 1): the starting count
        if role not in existing:
            await hand_over_replicas(api, owner, role, initial_replicas(spec, role))
    for api_version, kind, child in absent_children(spec, owner):
        await delete_if_present(api, api_version, kind, owner.namespace, child)
    return applied


async def _hold_decode(
    api: KubeApi,
    spec: S.DSV4DeploymentSpec,
    owner: Owner,
    wanted: dict[str, Any],
    prefill: Optional[dict[str, Any]] = None,
) -> bool:
    """Whether to apply decode held (manifests.decode_held); `prefill`: the prefill StatefulSet as
    just applied, else it is read."""
    if spec.rollout.order != "prefillFirst":
        return False  # no reads needed
    if prefill is None:
        prefill = await api.get("apps/v1", "StatefulSet", owner.namespace, child_name(owner.name, "prefill"))
    if prefill_rolled_out(prefill):
        return False
    live = await api.get("apps/v1", "StatefulSet", owner.namespace, wanted["metadata"]["name"])
    return decode_held(spec, False, live, wanted)


def _remember_generation(seen: Optional[dict], obj: Mapping[str, Any]) -> None:
    """Note the generation our own write gave a workload, so its watch event is not taken for drift."""
    if seen is not None and obj.get("kind") in ("StatefulSet", "Deployment"):
        meta = obj.get("metadata") or {}
        seen[(obj["kind"], meta.get("namespace"), meta.get("name"))] = meta.get("generation")


async def delete_if_present(api: KubeApi, api_version: str, kind: str, namespace: str, name: str) -> bool:
    """Delete a child the spec turned off; only one the operator made (it carries our
    managed-by label), so a user's object of the same name is left alone."""
    live = await api.get(api_version, kind, namespace, name)
    if live is None or (live["metadata"].get("labels") or {}).get(LABEL_MANAGED_BY) != MANAGER:
        return False
    try:
        await api.request("DELETE", path_of(live), body={"preconditions": {"uid": live["metadata"]["uid"]}})
    except ApiError as e:
        if e.status not in (404, 409):
            raise
    return True


# ---- Activities ------------------------------------------------------------------------------


@kopf.on.startup(registry=registry)
async def check_crd_installed(memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Fail fast, with one clear line, when the CRD is missing: with CRD scanning off, the
    operator would otherwise run and serve nothing."""
    _metrics(memo)
    # Shared by every handler (kopf gives each object a shallow copy of this memo): workload
    # generations our own writes produced, so that their watch events are not taken for drift.
    memo.setdefault("child_generations", {})
    api = KubeApi(await load_configuration(getattr(memo, "kubeconfig", None)))
    try:
        served = await api.served_resources(S.API_VERSION)
    except ApiError as e:
        raise kopf.PermanentError(f"cannot reach the Kubernetes API: {e}") from None
    finally:
        await api.close()
    if not served or S.PLURAL not in served:
        raise kopf.PermanentError(
            f"the CRD {S.PLURAL}.{S.GROUP} ({S.API_VERSION}) is not installed; apply crds/dsv4deployment.yaml first"
        )
    logger.info(f"{S.KIND} ({S.API_VERSION}) is served by the API server.")


@kopf.on.login(registry=registry)
async def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    """KUBECONFIG, else the pod's service account, else ~/.kube/config — for kopf and for the
    handlers' own client alike. Called again by kopf when the credentials stop working."""
    cfg = await load_configuration(getattr(memo, "kubeconfig", None))
    old = getattr(memo, "api", None)
    memo.api = KubeApi(cfg)
    if old is not None:
        await old.close()
    return await connection_info(cfg)


@kopf.on.cleanup(registry=registry)
async def close_client(memo: kopf.Memo, **_: Any) -> None:
    api = getattr(memo, "api", None)
    if api is not None:
        await api.close()
        memo.api = None


# ---- Indexes: what the children look like, kept current by kopf's watches ----------------------


def _index_child(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> Optional[dict]:
    obs = observe(body)
    instance = labels.get(LABEL_INSTANCE)
    if obs is None or not instance:
        return None
    return {(namespace, instance): obs}


# Handlers receive these indexes by their ids: dsv4_statefulsets[(namespace, instance)] -> observations.
kopf.index("apps", "v1", "statefulsets", id="dsv4_statefulsets", labels=CHILD_LABELS, registry=registry)(_index_child)
kopf.index("apps", "v1", "deployments", id="dsv4_deployments", labels=CHILD_LABELS, registry=registry)(_index_child)


@kopf.index(*CR, id="dsv4_resources", registry=registry)
def _index_resource(namespace: str, name: str, **_: Any) -> dict:
    return {(namespace, name): True}


# ---- The reconciler --------------------------------------------------------------------------


@kopf.on.resume(*CR, registry=registry)
@kopf.on.create(*CR, registry=registry)
@kopf.on.update(*CR, registry=registry)
async def reconcile(
    body: kopf.Body,
    spec: kopf.Spec,
    meta: kopf.Meta,
    name: str,
    namespace: str,
    uid: str,
    memo: kopf.Memo,
    logger: kopf.Logger,
    dsv4_statefulsets: kopf.Index,
    dsv4_deployments: kopf.Index,
    dsv4_resources: kopf.Index,
    retry: int = 0,
    **_: Any,
) -> None:
    metrics = _metrics(memo)
    metrics.deployments.set(len(dsv4_resources))
    api = _api(memo)
    generation = int(meta.get("generation") or 0)
    memo["seen_pin"] = _rollout_marks(meta.get("annotations"))

    def children() -> list[ChildObservation]:
        return _children(namespace, name, dsv4_statefulsets, dsv4_deployments)

    parsed, problem, pinned = effective_spec(name, spec, meta.get("annotations"), generation)
    if pinned is not None:
        kopf.event(
            body,
            type="Normal",
            reason="PinnedRevision",
            message=f"generation {generation} runs the pinned revision {pinned}, not the spec as written; "
            "the next edit of the spec ends the pin",
        )
    if parsed is None:
        metrics.reconciles.labels("invalid_spec").inc()
        kopf.warn(body, reason="InvalidSpec", message=problem or "invalid spec")
        logger.warning(f"Not acting on generation {generation}: {problem}")
        await refresh_status(api, metrics, namespace, name, children, observed_generation=generation, acted=True)
        return

    revision = S.spec_revision(parsed)
    started = time.monotonic()
    if parsed.model.volume is not None and parsed.model.volume.image is not None:
        try:
            refusal = await image_volume_refusal(api, parsed, Owner(name, namespace, uid))
        except ApiError as e:
            refusal = None if e.status != 400 else ApplyRefusal(f"model.volume.image: {e}", IMAGE_VOLUME_UNSUPPORTED)
        if refusal is not None:  # never silently run engines without their checkpoint
            metrics.reconciles.labels("apply_failed").inc()
            kopf.warn(body, reason=IMAGE_VOLUME_UNSUPPORTED, message=refusal)
            await refresh_status(
                api, metrics, namespace, name, children, observed_generation=generation, apply_error=refusal, acted=True
            )
            return
    try:
        existing = {child.role: child.spec_replicas for child in children()}
        applied = await apply_children(
            api, metrics, parsed, Owner(name, namespace, uid), existing, memo.setdefault("child_generations", {})
        )
    except AuthSecretRefused as e:  # the named Secret is not ours, or unusable: say so in status
        metrics.reconciles.labels("apply_failed").inc()
        if retry == 0:
            kopf.warn(body, reason=e.reason, message=str(e))
        await refresh_status(
            api,
            metrics,
            namespace,
            name,
            children,
            observed_generation=generation,
            apply_error=ApplyRefusal(str(e), e.reason),
            acted=True,
        )
        delay = auth_secret.SECRET_RECHECK_SECONDS  # one create + get: cheap, and a relabel is noticed soon
        raise kopf.TemporaryError(f"{e} (checked again in {delay:.0f}s)", delay=delay) from None
    except ApiError as e:
        metrics.api_errors.labels(str(e.status)).inc()
        metrics.reconciles.labels("apply_failed").inc()
        message = describe_apply_error(e)
        if retry == 0 or not e.transient:  # once per generation (and operator start), not per retry
            kopf.warn(body, reason="ApplyFailed", message=message)
        await refresh_status(
            api, metrics, namespace, name, children, observed_generation=generation, apply_error=message, acted=True
        )
        if e.transient:
            delay = retry_delay(retry)
            raise kopf.TemporaryError(
                f"applying the children failed (retry in {delay:.0f}s): {e}", delay=delay
            ) from None
        return  # the spec produced something the API server refuses: wait for a new spec
    metrics.reconcile_seconds.observe(time.monotonic() - started)
    metrics.reconciles.labels("applied").inc()
    kinds = ", ".join(f"{m['kind']}/{m['metadata']['name']}" for m in applied if m)
    kopf.event(body, type="Normal", reason="Applied", message=f"revision {revision}, generation {generation}: {kinds}")
    await refresh_status(
        api, metrics, namespace, name, children, observed_generation=generation, revision=revision, acted=True
    )


def _rollout_marks(annotations: Optional[Mapping[str, str]]) -> tuple[Optional[str], Optional[str]]:
    """What the reconciler builds from besides the spec: the rollback pin and the canary's gate."""
    return (annotations or {}).get(ANNOTATION_PINNED_REVISION), canary_plan.mark(annotations)


@kopf.on.event(*CR, id="pin_changed", registry=registry)
async def pin_changed(
    event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **kwargs: Any
) -> None:
    """kopf takes no annotation under our prefix for a change (its own bookkeeping lives there),
    so a rollback pin set or lifted by the watchdog is noticed here and acted on at once."""
    if event.get("type") not in ("ADDED", "MODIFIED") or body.get("metadata", {}).get("deletionTimestamp"):
        return
    pin = _rollout_marks(body["metadata"].get("annotations"))
    if "seen_pin" not in memo or memo["seen_pin"] == pin:
        return  # the reconcile has not run yet (it reads the pin itself), or nothing new
    logger.info(f"Rollback pin or canary now {pin}: re-applying.")
    indexes = {k: kwargs[k] for k in ("dsv4_statefulsets", "dsv4_deployments", "dsv4_resources")}
    meta = body["metadata"]
    await reconcile(
        body=body,
        spec=body.get("spec") or {},
        meta=meta,
        name=meta["name"],
        namespace=meta["namespace"],
        uid=meta["uid"],
        memo=memo,
        logger=logger,
        **indexes,
    )


# ---- Children: status from the workloads, drift put right ---------------------------------------
#
# Every kind of child is watched (by the labels the operator puts on them). A child deleted, or
# changed by someone else, is re-applied from the owner's spec at once: the one child, not all of
# them, and a no-op when nothing drifted (server-side apply writes nothing then, so no new event
# and no loop). Workloads report status changes all the time: those are re-applied only when
# their generation moved (a spec edit), and their events also refresh the owner's status.

WORKLOAD_KINDS = (("apps", "v1", "statefulsets"), ("apps", "v1", "deployments"))
OTHER_CHILD_KINDS = (
    ("", "v1", "services"),
    ("", "v1", "serviceaccounts"),
    ("rbac.authorization.k8s.io", "v1", "roles"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("networking.k8s.io", "v1", "networkpolicies"),
)


def drift_worth_reapplying(
    event_type: Optional[str], kind: str, generation: Optional[int], last_generation: Optional[int]
) -> bool:
    """Pure: whether a child's watch event may mean someone changed what the operator owns.
    A listing (type None) counts as a change: after a watch is told 410 Gone, kopf lists again and
    a child edited meanwhile arrives only that way (the caller then repairs only a child whose
    last write was someone else's, so the listing at start costs nothing for our own children)."""
    if event_type == "DELETED":
        return True
    if event_type not in ("MODIFIED", None):
        return False  # ADDED: just made by us, where the reconcile applies anyway
    if kind in ("StatefulSet", "Deployment"):
        return generation is not None and last_generation is not None and generation != last_generation
    return True


async def _child_changed(
    event: kopf.RawEvent,
    namespace: str,
    labels: kopf.Labels,
    memo: kopf.Memo,
    logger: kopf.Logger,
    dsv4_statefulsets: kopf.Index,
    dsv4_deployments: kopf.Index,
    **_: Any,
) -> None:
    owner_name = labels.get(LABEL_INSTANCE)
    api = getattr(memo, "api", None)
    obj = event.get("object") or {}
    kind, meta = obj.get("kind", ""), obj.get("metadata") or {}
    if not owner_name or api is None or not kind:
        return
    metrics = _metrics(memo)
    generations = memo.setdefault("child_generations", {})  # (kind, namespace, name) -> last generation
    key = (kind, namespace, meta.get("name"))
    generation = meta.get("generation")
    last = generations.get(key)
    if event.get("type") == "DELETED":
        generations.pop(key, None)
    elif generation is not None:
        generations[key] = generation
    reapply = drift_worth_reapplying(event.get("type"), kind, generation, last)
    target, seen = meta.get("name", ""), None if event.get("type") == "DELETED" else meta.get("resourceVersion")
    if (
        not reapply
        and kind == "StatefulSet"
        and labels.get(LABEL_ROLE) == "prefill"
        and event.get("type") != "DELETED"
        and prefill_rolled_out(obj)
    ):
        # Prefill finished rolling out: a held decode StatefulSet may take its new template now.
        reapply, target, seen = True, child_name(owner_name, "decode"), ""
    fights: FightTracker = memo.setdefault("fights", FightTracker())
    if reapply and seen and not foreign_write(obj):
        reapply = False  # our own write (a repair's JSON patch, an apply) seen back: nothing to repair
    if reapply and seen:  # changed by someone else: answer a writer that keeps at it with back-off
        fight_key = (kind, namespace, target)
        decision = fights.decide(fight_key, time.monotonic())
        if decision.warn:
            other = other_manager(meta.get("managedFields"), (MANAGER, SCALE_MANAGER)) or "an unnamed writer"
            cr_ref = {
                "apiVersion": S.API_VERSION,
                "kind": S.KIND,
                "metadata": {"name": owner_name, "namespace": namespace},
            }
            kopf.event(
                await api.get(S.API_VERSION, S.KIND, namespace, owner_name) or cr_ref,
                type="Warning",
                reason="FightingWriter",
                message=f"{kind}/{target} keeps being changed by {other}; the operator puts it back with "
                f"back-off (now {decision.delay:.0f}s between repairs, at most "
                f"{fights.cap:.0f}s): stop the other writer or make it leave the operator's fields alone",
            )
        if decision.delay > 0:
            pending = memo.setdefault("delayed_repairs", {})
            if fight_key not in pending or pending[fight_key].done():
                pending[fight_key] = asyncio.ensure_future(
                    _delayed_repair(
                        decision.delay,
                        api,
                        metrics,
                        namespace,
                        owner_name,
                        kind,
                        target,
                        generations,
                        fights,
                        fight_key,
                        logger,
                    )
                )
            reapply = False
    for attempt in range(REPAIR_ATTEMPTS if reapply else 0):
        try:
            restored = await _reapply_child(
                api,
                metrics,
                namespace,
                owner_name,
                kind,
                target,
                seen_version=seen,
                generations=generations,
                logger=logger,
            )
            if restored and seen:  # only a repair that changed something counts towards a fight
                fights.repaired((kind, namespace, target), time.monotonic())
            break
        except ApiError as e:  # kopf does not retry event handlers: a few tries here, then the next event
            metrics.api_errors.labels(str(e.status)).inc()
            logger.warning(
                f"Could not re-apply {kind} {namespace}/{meta.get('name')} "
                f"(attempt {attempt + 1} of {REPAIR_ATTEMPTS}): {e}"
            )
            if attempt + 1 < REPAIR_ATTEMPTS:
                await asyncio.sleep(0.5 * 2**attempt)
    if obj.get("kind") in ("StatefulSet", "Deployment"):
        await refresh_status(
            api,
            metrics,
            namespace,
            owner_name,
            lambda: _children(namespace, owner_name, dsv4_statefulsets, dsv4_deployments),
        )


async def remove_foreign_entries(
    api: KubeApi, manifest: Mapping[str, Any], live: Optional[Mapping[str, Any]] = None
) -> list[str]:
    """Take out of a live child the list entries the manifest does not name and the foreign labels
    of its pod template and selectors (drift.py), by one
    JSON patch conditioned on the resourceVersion read (a concurrent write makes it a 422 and
    the caller's retry reads again). Returns what was removed."""
    meta = manifest["metadata"]
    if live is None:
        live = await api.get(manifest["apiVersion"], manifest["kind"], meta.get("namespace"), meta["name"])
    if live is None:
        return []
    ops = foreign_label_removals(live, manifest) + foreign_entry_removals(live, manifest)
    if not ops:
        return []
    test = {"op": "test", "path": "/metadata/resourceVersion", "value": live["metadata"]["resourceVersion"]}
    await api.request(
        "PATCH",
        path_of(live),
        body=[test, *ops],
        content_type="application/json-patch+json",
        query=[("fieldManager", api.field_manager)],
    )
    return describe_removals(live, ops)


async def apply_repairing(api: KubeApi, manifest: Mapping[str, Any]) -> dict[str, Any]:
    """Apply; when the merge by key with someone else's list entries makes the object invalid
    (two Service ports named `http`: 422), remove those entries and apply again, once."""
    try:
        return await api.apply(manifest)
    except ApiError as e:
        if e.status != 422 or not await remove_foreign_entries(api, manifest):
            raise
    return await api.apply(manifest)


REPAIR_ATTEMPTS = 3  # event handlers are not retried by kopf: a repair retries itself


def foreign_write(obj: Mapping[str, Any]) -> bool:
    """Pure: the last write to a child (managedFields' latest entry) was not the operator's. Without
    managedFields (an API server that does not report them) every change counts as foreign."""
    entries = [
        m for m in (obj.get("metadata") or {}).get("managedFields") or [] if m.get("subresource") != "status"
    ]  # a controller's status write changes nothing we own
    if not entries:
        return True
    latest = max(entries, key=lambda m: str(m.get("time") or ""))
    return latest.get("manager") not in (MANAGER, SCALE_MANAGER)


_API_VERSION_OF_KIND = {
    "StatefulSet": "apps/v1",
    "Deployment": "apps/v1",
    "Role": "rbac.authorization.k8s.io/v1",
    "RoleBinding": "rbac.authorization.k8s.io/v1",
    "PodDisruptionBudget": "policy/v1",
    "NetworkPolicy": "networking.k8s.io/v1",
}


async def _delayed_repair(
    delay: float,
    api: KubeApi,
    metrics: OperatorMetrics,
    namespace: str,
    owner_name: str,
    kind: str,
    name: str,
    generations: dict,
    fights: FightTracker,
    fight_key: tuple,
    logger: kopf.Logger,
) -> None:
    """The repair of a child in a fight, after its back-off: one apply of whatever the child is then."""
    await asyncio.sleep(delay)
    try:
        live = await api.get(_API_VERSION_OF_KIND.get(kind, "v1"), kind, namespace, name)
        if await _reapply_child(
            api,
            metrics,
            namespace,
            owner_name,
            kind,
            name,
            seen_version=None if live is None else live["metadata"]["resourceVersion"],
            generations=generations,
            logger=logger,
        ):
            fights.repaired(fight_key, time.monotonic(), backed_off=True)  # still fighting: the next wait doubles
    except ApiError as e:
        metrics.api_errors.labels(str(e.status)).inc()
        logger.warning(f"Could not re-apply {kind} {namespace}/{name} after back-off: {e}")


async def _reapply_child(
    api: KubeApi,
    metrics: OperatorMetrics,
    namespace: str,
    owner_name: str,
    kind: str,
    name: str,
    *,
    seen_version: Optional[str],
    generations: Optional[dict] = None,
    logger: kopf.Logger,
) -> bool:
    """Apply the owner's current version of one child (`seen_version`: the resourceVersion the
    event showed; None: it was deleted). Nothing when the owner is gone or being deleted (the
    garbage collector is removing its children), or its spec cannot be acted on. True when it
    put something back (a write that changed the child)."""
    cr = await api.get(S.API_VERSION, S.KIND, namespace, owner_name)
    if cr is None or cr["metadata"].get("deletionTimestamp"):
        return False
    spec, _, _ = effective_spec(
        owner_name, cr.get("spec"), cr["metadata"].get("annotations"), int(cr["metadata"].get("generation") or 0)
    )
    if spec is None:
        return False
    owner = Owner(owner_name, namespace, cr["metadata"]["uid"])
    wanted = [
        m
        for m in build_children(spec, owner, operator_namespace())
        if m["kind"] == kind and m["metadata"]["name"] == name
    ]
    if not wanted:
        return False  # not (or no longer) one the spec asks for
    if seen_version == "":  # a release: only a decode StatefulSet that is held has anything to take
        live = await api.get("apps/v1", "StatefulSet", namespace, name)
        partition = (((live or {}).get("spec") or {}).get("updateStrategy") or {}).get("rollingUpdate") or {}
        if partition.get("partition") != HOLD_PARTITION:
            return False
    if (
        kind == "StatefulSet"
        and name == child_name(owner_name, "decode")
        and await _hold_decode(api, spec, owner, wanted[0])
    ):
        wanted = [engine_statefulset(spec, owner, "decode", S.spec_revision(spec), hold=True)]
    removed = [] if seen_version in (None, "") else await remove_foreign_entries(api, wanted[0])
    if removed:
        kopf.event(
            cr,
            type="Normal",
            reason="Restored",
            message=f"{kind}/{name}: removed entries the operator does not write (list entries, pod-template or selector labels): {', '.join(removed)}",
        )
    after = await apply_repairing(api, wanted[0])
    _remember_generation(generations, after)
    metrics.applied.labels(kind).inc()
    role = (wanted[0]["metadata"].get("labels") or {}).get(LABEL_ROLE, "")
    if seen_version is None and kind in ("StatefulSet", "Deployment") and spec.replicas_from_workload(role):
        await hand_over_replicas(api, owner, role, initial_replicas(spec, role))  # made anew: starting count
    if seen_version == "":
        return False  # a release of decode after prefill rolled out, not a repair
    if seen_version is None or seen_version != after["metadata"].get("resourceVersion"):
        what = "deleted" if seen_version is None else "changed by someone else"
        kopf.event(cr, type="Normal", reason="Restored", message=f"{kind}/{name} was {what}: re-applied")
        logger.info(f"Re-applied {kind} {namespace}/{name}: it was {what}.")
        return True
    return bool(removed)


for _group, _version, _plural in (*WORKLOAD_KINDS, *OTHER_CHILD_KINDS):
    kopf.on.event(_group, _version, _plural, id=f"{_plural}_changed", labels=CHILD_LABELS, registry=registry)(
        _child_changed
    )


# ---- Pods the StatefulSet controller cannot create (pod_creation) ------------------------------


@kopf.on.event("", "v1", "events", id="pod_creation_failed", field="reason", value=FAILED_CREATE, registry=registry)
async def pod_creation_failed(
    event: kopf.RawEvent, memo: kopf.Memo, dsv4_statefulsets: kopf.Index, dsv4_deployments: kopf.Index, **_: Any
) -> None:
    """A StatefulSet of ours could not make a pod (Pod Security admission, a quota...): the
    owner's status says so, Degraded with the controller's message. main narrows this watch to
    such Events on the API server."""
    failure = creation_failure(event.get("object") or {})
    api = getattr(memo, "api", None)
    if failure is None or event.get("type") == "DELETED":
        return
    # Kept even when the StatefulSet is not in the index yet (the Event can come first): its own
    # watch event refreshes the owner's status then.
    CREATION_FAILURES.record(failure)
    for (namespace, owner_name), observations in dsv4_statefulsets.items():
        if (
            api is not None
            and namespace == failure.namespace
            and any(o is not None and o.name == failure.statefulset for o in observations)
        ):
            await refresh_status(
                api,
                _metrics(memo),
                namespace,
                owner_name,
                lambda ns=namespace, name=owner_name: _children(ns, name, dsv4_statefulsets, dsv4_deployments),
            )
            return


# ---- The wedge watchdog -----------------------------------------------------------------------


@kopf.daemon(*CR, id="wedge_watchdog", registry=registry, cancellation_backoff=1.0, cancellation_timeout=10.0)
async def wedge_watchdog(
    stopped: kopf.DaemonStopped, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, dsv4_pods: kopf.Index, **_: Any
) -> None:
    """Scrape, judge and heal this deployment's engine pods for as long as it exists. `body` is
    kopf's live view of the resource: spec edits reach the running loop."""

    def post(type_: str, reason: str, message: str) -> None:
        kopf.event(body, type=type_, reason=reason, message=message)

    def pods(namespace: str, instance: str) -> list:
        return list(dsv4_pods.get((namespace, instance), []))

    admin_token, attempt, warned = None, 0, False
    while admin_token is None and not stopped:
        try:
            admin_token = await deployment_admin_token(
                _api(memo), body["metadata"]["namespace"], body["metadata"]["name"]
            )
        except (ApiError, kopf.TemporaryError, AuthSecretRefused) as e:
            logger.warning(f"Cannot read the deployment's admin token yet: {e}")
            if isinstance(e, ApiError) and e.status == 403 and not warned:  # no token, no watchdog: say so once
                post(
                    "Warning",
                    "WatchdogWaiting",
                    f"the wedge watchdog cannot read or create the auth Secret: {describe_apply_error(e)}",
                )
                warned = True
        if admin_token is None:
            await stopped.wait(min(2.0 * 2**attempt, 60.0))
            attempt += 1
    if stopped:
        return
    watchdog = DeploymentWatchdog(
        lambda: _api(memo),
        _metrics(memo),
        body,
        post,
        logger,
        admin_token=admin_token,
        fleet=getattr(memo, "fleet", None),
        pods=pods,
    )
    await watchdog.run(stopped)


# The watchdog's engine pods, from one pod watch (main narrows it by label selector).
@kopf.index("", "v1", "pods", id="dsv4_pods", labels={LABEL_NAME: APP}, registry=registry)
def _index_engine_pod(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> Optional[dict]:
    key = engine_pod_index_key(namespace, labels)
    return None if key is None else {key: pod_snapshot(body)}
