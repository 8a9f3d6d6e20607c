"""The children's handlers: each child's events refresh its owner's status, and a child deleted
or changed by someone else is put back (drift repair, with back-off against a writer that keeps
at it); a pod the StatefulSet controller cannot create makes the owner Degraded.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Mapping, Optional

import kopf

from dsv4_operator.handlers.apply import (
    _hold_decode,
    _remember_generation,
    apply_repairing,
    effective_spec,
    hand_over_replicas,
    operator_namespace,
    refresh_status,
    remove_foreign_entries,
)
from dsv4_operator.handlers.registry import CHILD_LABELS, _children, _metrics, registry
from dsv4_operator import spec as S
from dsv4_operator.fight import FightTracker, other_manager
from dsv4_operator.kube import ApiError, KubeApi
from dsv4_operator.manifests import (
    LABEL_INSTANCE,
    LABEL_ROLE,
    MANAGER,
    HOLD_PARTITION,
    SCALE_MANAGER,
    Owner,
    build_children,
    child_name,
    engine_workload,
    initial_replicas,
    partition_of,
    prefill_rolled_out,
    workload_kind,
)
from dsv4_operator.pod_creation import CREATION_FAILURES, FAILED_CREATE, creation_failure
from dsv4_operator.telemetry import OperatorMetrics
from dsv4_operator.workload_form import lws_served


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
    lws = await lws_served(api)
    # A LeaderWorkerSet makes a StatefulSet of its own name (with our labels): that one's events
    # stand for the LeaderWorkerSet.
    kinds = (kind, "LeaderWorkerSet") if kind == "StatefulSet" else (kind,)
    wanted = [
        m
        for m in build_children(spec, owner, operator_namespace(), lws=lws)
        if m["kind"] in kinds and m["metadata"]["name"] == name
    ]
    if not wanted:
        return False  # not (or no longer) one the spec asks for
    if seen_version == "":  # a release: only a decode StatefulSet that is held has anything to take
        live = await api.get(wanted[0]["apiVersion"], wanted[0]["kind"], namespace, name)
        if partition_of(live) != HOLD_PARTITION:
            return False
    if wanted[0]["kind"] == "LeaderWorkerSet" and seen_version not in (None, ""):
        return False  # LeaderWorkerSet writes its own StatefulSet: not drift of ours
    if (
        kind in ("StatefulSet", "LeaderWorkerSet")
        and name == child_name(owner_name, "decode")
        and await _hold_decode(api, spec, owner, wanted[0], lws=lws)
    ):
        wanted = [engine_workload(spec, owner, "decode", S.spec_revision(spec), hold=True, lws=lws)]
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
        # made anew: its starting count
        await hand_over_replicas(api, owner, role, initial_replicas(spec, role), workload_kind(spec, role, lws))
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
