"""The reconciler: validate a DSV4Deployment's spec, server-side-apply every child, write the
status. A spec the operator cannot act on becomes Degraded=True (reason InvalidSpec) and a Warning
Event, once per generation: no exception, so no retry loop and no crash loop. Deleting a
DSV4Deployment needs no handler: every child has an ownerReference to it and the API server's
garbage collector removes them. Thin shells around `manifests` and `status`.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Any, Callable, Iterable, Mapping, Optional

import kopf
from pydantic import ValidationError

from dsv4_operator.handlers.registry import CR, _api, _children, _metrics, registry
from dsv4_operator import auth_secret, spec as S
from dsv4_operator.auth_secret import AuthSecretRefused, ensure_auth_secret
from dsv4_operator.drift import describe_removals, foreign_entry_removals, foreign_label_removals
from dsv4_operator.kube import ApiError, KubeApi, path_of
from dsv4_operator.manifests import (
    ADMIN_TOKEN_KEY,
    LABEL_MANAGED_BY,
    MANAGER,
    HOLD_PARTITION,
    SCALE_MANAGER,
    Owner,
    absent_children,
    build_children,
    child_name,
    decode_held,
    engine_statefulset,
    engine_workload,
    initial_replicas,
    prefill_rolled_out,
    scale_handover,
    unbuildable_reasons,
    workload_kind,
)
from dsv4_operator.canary import plan as canary_plan
from dsv4_operator.pinning import pinned_spec
from dsv4_operator.pod_creation import CREATION_FAILURES
from dsv4_operator.workload_form import lws_served, remove_replaced
from dsv4_operator.status import (
    APPLY_REFUSAL_REASONS,
    ROLES,
    ApplyRefusal,
    ChildObservation,
    compute_status,
    operator_identity,
    remediation_counts,
    status_changed,
)
from dsv4_operator.telemetry import OperatorMetrics
from dsv4_operator.tenant_policy import TenantPolicy, policy_violations
from dsv4_wire import ANNOTATION_PINNED_REVISION

# What a DSV4Deployment may ask for on this cluster (the chart's tenantPolicy); read once.
TENANT_POLICY = TenantPolicy.from_env()

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
            watched_by=operator_identity(os.environ, socket.gethostname()),
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


async def deployment_tokens(api: KubeApi, namespace: str, name: str) -> Optional[dict[str, str]]:
    """The values of a deployment's auth Secret (ADMIN_TOKEN_KEY for its engines,
    ROUTER_ADMIN_TOKEN_KEY for its routers). None when the resource is gone or its spec cannot be
    acted on."""
    cr = await api.get(S.API_VERSION, S.KIND, namespace, name)
    if cr is None:
        return None
    spec, _ = check_spec(name, cr.get("spec"))
    if spec is None:
        return None
    return await ensure_auth_secret(api, spec, Owner(name, namespace, cr["metadata"]["uid"]))


async def deployment_admin_token(api: KubeApi, namespace: str, name: str) -> Optional[str]:
    """The engines' admin token of a deployment, for the operator's own calls to its engines (the
    watchdog's drain and abort); never for its routers, which hold their own token."""
    values = await deployment_tokens(api, namespace, name)
    return None if values is None else values.get(ADMIN_TOKEN_KEY)


async def hand_over_replicas(
    api: KubeApi, owner: Owner, role: str, replicas: int, kind: tuple[str, str] = ("apps/v1", "StatefulSet")
) -> None:
    """Apply a workload's replicas alone as SCALE_MANAGER (see manifests.scale_handover). Not
    forced: if an autoscaler already set another value, it owns the field, as it should."""
    manifest = scale_handover(owner, role, replicas, kind)
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
    lws = await lws_served(api)  # multi-node roles: LeaderWorkerSets where the cluster has them
    await remove_replaced(api, spec, owner, lws)  # a workload of the other form must go first
    existing = existing_replicas or {}
    external = [role for role in ROLES if spec.replicas_from_workload(role)]
    for role in external:  # before our apply stops carrying replicas, so the count stays
        if role in existing:
            await hand_over_replicas(api, owner, role, existing[role], workload_kind(spec, role, lws))
    applied = []
    prefill: Optional[dict[str, Any]] = None
    prefill_name, decode_name = child_name(owner.name, "prefill"), child_name(owner.name, "decode")
    for manifest in build_children(spec, owner, operator_namespace(), lws=lws):
        is_sts = manifest["kind"] in ("StatefulSet", "LeaderWorkerSet")
        if (
            is_sts
            and manifest["metadata"]["name"] == decode_name
            and await _hold_decode(api, spec, owner, manifest, prefill or {}, lws)
        ):
            manifest = engine_workload(spec, owner, "decode", S.spec_revision(spec), hold=True, lws=lws)
        result = await apply_repairing(api, manifest)
        _remember_generation(seen, result)
        if is_sts and manifest["metadata"]["name"] == prefill_name:
            prefill = result
        applied.append(result)
        metrics.applied.labels(manifest["kind"]).inc()
    for role in external:  # just created (at the default of 1): the starting count
        if role not in existing:
            await hand_over_replicas(api, owner, role, initial_replicas(spec, role), workload_kind(spec, role, lws))
    for api_version, kind, child in absent_children(spec, owner):
        await delete_if_present(api, api_version, kind, owner.namespace, child)
    return applied


async def _hold_decode(
    api: KubeApi,
    spec: S.DSV4DeploymentSpec,
    owner: Owner,
    wanted: dict[str, Any],
    prefill: Optional[dict[str, Any]] = None,
    lws: bool = False,
) -> bool:
    """Whether to apply decode held (manifests.decode_held); `prefill`: the prefill StatefulSet as
    just applied, else it is read."""
    if spec.rollout.order != "prefillFirst":
        return False  # no reads needed
    if prefill is None:
        prefill = await api.get(
            *workload_kind(spec, "prefill", lws), owner.namespace, child_name(owner.name, "prefill")
        )
    if prefill_rolled_out(prefill):
        return False
    live = await api.get(wanted["apiVersion"], wanted["kind"], owner.namespace, wanted["metadata"]["name"])
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
