"""The StatefulSet pair's group controller: what LeaderWorkerSet's controller does for its groups,
done by the operator where LWS is not installed. A thin kopf shell around dsv4_operator.groups.

On every event of a group's pod (a pod with the group-size label, not made by LWS):
- a leader pod that lives gets its worker StatefulSet (made from the worker template the leader
  carries, owned by the leader); one left by an earlier incarnation of the leader is deleted first;
- a pod of the current incarnation deleted (a worker), or with a container restarted, recreates
  the whole group (groups.recreate_decision): the leader pod is deleted, with its uid as
  precondition, so its worker StatefulSet and workers go with it and its StatefulSet makes it
  anew. Once per leader incarnation, with exponential backoff from the second time in a row (an
  Event says when it is held and when it is done).

The group records (backoff, incarnations recreated) live in the operator's memory: a restarted
operator starts them afresh (its first recreation of a group is then immediate).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

import kopf

from dsv4_operator import groups as G
from dsv4_operator import spec as S
from dsv4_operator.handlers.registry import registry
from dsv4_operator.kube import ApiError, KubeApi, resource_path
from dsv4_wire import APP, LABEL_INSTANCE, LABEL_NAME, LABEL_ROLE
from dsv4_wire.groups import group_member
from dsv4_wire.k8s import LABEL_GROUP_SIZE

STALE_WAIT_S = 0.5  # between looks while a worker StatefulSet of a deleted leader is garbage-collected
STALE_TRIES = 20


class GroupRecords:
    """Per (namespace, group): its GroupRecord, a lock, a pending held recreation."""

    def __init__(self) -> None:
        self.records: dict[tuple[str, str], G.GroupRecord] = {}
        self.locks: dict[tuple[str, str], asyncio.Lock] = {}
        self.pending: dict[tuple[str, str], asyncio.Task] = {}

    def lock(self, key: tuple[str, str]) -> asyncio.Lock:
        return self.locks.setdefault(key, asyncio.Lock())


def _records(memo: kopf.Memo) -> GroupRecords:
    if getattr(memo, "group_records", None) is None:
        memo.group_records = GroupRecords()
    return memo.group_records


async def _post(api: KubeApi, namespace: str, instance: str, type_: str, reason: str, message: str) -> None:
    cr = await api.get(S.API_VERSION, S.KIND, namespace, instance)
    if cr is not None:
        kopf.event(cr, type=type_, reason=reason, message=message)


async def ensure_workers(api: KubeApi, leader: dict[str, Any], instance: str, logger: Any) -> Optional[str]:
    """Make the leader's worker StatefulSet when it has none of its own; returns what was done."""
    meta = leader["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    for _ in range(STALE_TRIES):
        live = await api.get("apps/v1", "StatefulSet", namespace, name)
        if live is not None and G.worker_set_of(live) == uid:
            return None  # this incarnation's own
        if live is None:
            break
        # A worker StatefulSet of an earlier leader, not yet collected: it goes first.
        try:
            await api.request(
                "DELETE",
                resource_path("apps/v1", "statefulsets", namespace, name),
                body={"preconditions": {"uid": live["metadata"]["uid"]}, "propagationPolicy": "Background"},
            )
        except ApiError as e:
            if e.status not in (404, 409):
                raise
        await asyncio.sleep(STALE_WAIT_S)
    cr = await api.get(S.API_VERSION, S.KIND, namespace, instance)
    if cr is None or cr["metadata"].get("deletionTimestamp"):
        return None
    try:
        role = S.parse_spec(cr.get("spec")).role(meta["labels"][LABEL_ROLE])
    except Exception:  # the reconciler reports a spec it cannot read
        return None
    manifest = G.worker_statefulset(leader, role.group_topology.key, role.group_topology.required)
    if manifest is None:
        return None
    try:
        await api.request(
            "POST", resource_path("apps/v1", "statefulsets", namespace), body=manifest, content_type="application/json"
        )
    except ApiError as e:
        if e.status == 409:
            return None  # made meanwhile (another event of the same leader)
        raise
    logger.info(f"Made the worker StatefulSet of group {name} (leader uid {uid}).")
    return f"made StatefulSet/{name}"


async def recreate(
    api: KubeApi, records: GroupRecords, namespace: str, instance: str, decision: G.Recreate, logger: Any
) -> bool:
    """Delete the group's leader (uid precondition): the group is made anew, whole."""
    key = (namespace, decision.leader)
    rec = records.records.setdefault(key, G.GroupRecord())
    try:
        await api.request(
            "DELETE",
            resource_path("v1", "pods", namespace, decision.leader),
            body={"preconditions": {"uid": decision.uid}, "propagationPolicy": "Background"},
        )
    except ApiError as e:
        if e.status not in (404, 409):  # gone or replaced already: nothing to do
            raise
        return False
    now = time.monotonic()
    rec.count = 1 if now - rec.last_at >= G.RESET_AFTER_S else rec.count + 1
    rec.last_at = now
    rec.leader_uids.add(decision.uid)
    message = f"group {decision.leader}: {decision.why}; deleted its leader pod (uid {decision.uid}) to start the whole group anew"
    logger.warning(message)
    await _post(api, namespace, instance, "Normal", "GroupRecreated", message)
    return True


async def handle_group_pod(
    api: KubeApi, records: GroupRecords, pod: dict[str, Any], deleted: bool, logger: Any
) -> None:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    namespace = meta.get("namespace")
    instance, role = labels.get(LABEL_INSTANCE), labels.get(LABEL_ROLE)
    if not namespace or not instance or not role or G.LWS_NAME_LABEL in labels:
        return  # a LeaderWorkerSet's pod: LWS keeps its groups
    member = group_member(pod, instance, role)
    if member is None:
        return
    group, node = member
    key = (namespace, group)
    async with records.lock(key):
        leader = pod if node == 0 and not deleted else await api.get("v1", "Pod", namespace, group)
        workers = await api.get("apps/v1", "StatefulSet", namespace, group) if node != 0 else None
        now = time.monotonic()
        decision = G.recreate_decision(
            pod,
            deleted,
            leader,
            (workers or {}).get("metadata", {}).get("uid"),
            records.records.get(key),
            now,
            instance,
            role,
        )
        if decision is not None and decision.wait_s > 0:
            if key not in records.pending or records.pending[key].done():
                await _post(
                    api,
                    namespace,
                    instance,
                    "Warning",
                    "GroupRecreationHeld",
                    f"group {group}: {decision.why}; recreated {records.records[key].count} time(s) in a row, "
                    f"so the next waits {decision.wait_s:.0f} s (backoff)",
                )
                records.pending[key] = asyncio.ensure_future(
                    _later(api, records, pod, deleted, decision.wait_s, logger)
                )
            return
        if decision is not None:
            await recreate(api, records, namespace, instance, decision, logger)
            return
        lmeta = (leader or {}).get("metadata") or {}
        if node == 0 and leader is not None and not deleted and not lmeta.get("deletionTimestamp"):
            await ensure_workers(api, leader, instance, logger)


async def _later(api: KubeApi, records: GroupRecords, pod: dict, deleted: bool, wait: float, logger: Any) -> None:
    await asyncio.sleep(wait)
    meta = pod["metadata"]
    current = None if deleted else await api.get("v1", "Pod", meta["namespace"], meta["name"])
    try:
        await handle_group_pod(api, records, current or pod, deleted or current is None, logger)
    except ApiError as e:
        logger.warning(f"Group recreation of {meta['name']}'s group after backoff failed: {e}")


@kopf.on.event(
    "", "v1", "pods", id="engine_groups", labels={LABEL_NAME: APP, LABEL_GROUP_SIZE: kopf.PRESENT}, registry=registry
)
async def group_pod_changed(event: kopf.RawEvent, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    api = getattr(memo, "api", None)
    pod = event.get("object") or {}
    if api is None or not pod:
        return
    fleet = getattr(memo, "fleet", None)
    if fleet is not None and not fleet.may_act():
        return  # not the leader: the one that is acts
    try:
        await handle_group_pod(api, _records(memo), pod, event.get("type") == "DELETED", logger)
    except ApiError as e:  # kopf does not retry event handlers: the next event of the group does
        logger.warning(f"Group of pod {(pod.get('metadata') or {}).get('name')}: {e}")
