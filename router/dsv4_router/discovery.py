"""Kubernetes discovery for the router: engine pods found by label selector, kept in sync by a
watch. A pod serves traffic while it is Running with an IP, not being deleted, and not
labelled serving.dsv4.dev/draining=true (how the operator drains a wedged pod). With `owners`
(--owner, which the operator always passes) it must also be controlled by one of those
StatefulSets: labels alone can be copied onto any pod, and a worker gets user traffic and the
PD secret. A multi-node engine (a group of pods, dsv4_wire.groups) is one worker, its leader,
and only while the group is whole: a group missing a node, or with one not ready or terminating,
is taken out of the rotation at the pod event, before any health check."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Mapping, Optional, Sequence

from dsv4_wire import LABEL_DRAINING, LABEL_INSTANCE, LABEL_ROLE, owned_engine_pod
from dsv4_wire.groups import group_size, is_worker_node, whole_groups

log = logging.getLogger("dsv4.router.discovery")
DEFAULT_PORT = 8100


def _get(obj: Any, *path: str) -> Any:
    for key in path:
        if obj is None:
            return None
        obj = obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)
    return obj


def pod_worker(pod: Mapping, owners: Sequence[str] = ()) -> Optional[tuple[str, str]]:
    """(url, role) of an engine pod that should take traffic, else None. `owners`: the
    StatefulSets one of which must control the pod (empty: labels suffice). Pure."""
    labels = _get(pod, "metadata", "labels") or {}
    role = labels.get(LABEL_ROLE)
    if role not in ("prefill", "decode", "mono"):
        return None
    if owners and not owned_engine_pod(_get(pod, "metadata") or {}, list(owners)):
        return None
    if str(labels.get(LABEL_DRAINING, "")).lower() == "true" or _get(pod, "metadata", "deletionTimestamp"):
        return None
    ip = _get(pod, "status", "podIP")
    if _get(pod, "status", "phase") != "Running" or not ip:
        return None
    port = DEFAULT_PORT
    for c in _get(pod, "spec", "containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == "http":
                port = int(p["containerPort"])
    return f"http://{ip}:{port}", role


def serving_workers(pods: Mapping[str, Mapping], owners: Sequence[str] = ()) -> set[tuple[str, str]]:
    """(url, role) of every pod that should take traffic: pod_worker's, where a group of pods
    counts once, by its leader, and only while whole. Pure."""
    wanted = set()
    whole: dict[tuple[str, str], set[str]] = {}
    for pod in pods.values():
        w = pod_worker(pod, owners)
        if w is None or is_worker_node(pod):
            continue
        if group_size(pod) > 1:
            key = (str((_get(pod, "metadata", "labels") or {}).get(LABEL_INSTANCE) or ""), w[1])
            if key not in whole:
                whole[key] = whole_groups(pods.values(), *key)
            if _get(pod, "metadata", "name") not in whole[key]:
                continue
        wanted.add(w)
    return wanted


def sync(router, pods: Mapping[str, Mapping]) -> None:
    """Make the router's Kubernetes-sourced workers exactly the serving pods given."""
    owners = getattr(router.args, "owners", None) or ()
    wanted = serving_workers(pods, owners)
    for url, w in list(router.pool.workers.items()):
        if w.source == "kubernetes" and (url, w.role) not in wanted:
            router.pool.remove(url)
            log.info("worker %s (%s) left the rotation", url, w.role)
    for url, role in wanted:
        if url not in router.pool.workers:
            router.pool.add(url, role, source="kubernetes")
            log.info("worker %s (%s) discovered", url, role)


async def watch_pods(router, namespace: str, selector: Optional[str]) -> None:
    """List, then watch, the namespace's engine pods; relist after any error."""
    from kubernetes_asyncio import client, config, watch
    from kubernetes_asyncio.config import ConfigException

    try:
        config.load_incluster_config()
    except ConfigException:
        # KUBECONFIG read now: the library's default path was fixed when it was first imported.
        await config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    async with client.ApiClient() as api_client:
        api = client.CoreV1Api(api_client)
        while True:
            try:
                listed = await api.list_namespaced_pod(namespace, label_selector=selector or "")
                pods = {p.metadata.name: api_client.sanitize_for_serialization(p) for p in listed.items}
                sync(router, pods)
                await _check_new(router)
                w = watch.Watch()
                async with w.stream(
                    api.list_namespaced_pod,
                    namespace,
                    label_selector=selector or "",
                    resource_version=listed.metadata.resource_version,
                    timeout_seconds=300,
                ) as events:
                    async for ev in events:
                        obj = (
                            ev["raw_object"]
                            if "raw_object" in ev
                            else api_client.sanitize_for_serialization(ev["object"])
                        )
                        name = _get(obj, "metadata", "name")
                        if ev["type"] == "DELETED":
                            pods.pop(name, None)
                        else:
                            pods[name] = obj
                        sync(router, pods)
                        await _check_new(router)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # API restarts, expired resource versions: relist
                log.warning("pod watch failed (%s); relisting in 2s", e)
                await asyncio.sleep(2)


async def _check_new(router) -> None:
    """Health-check workers not checked yet, so new pods join without waiting a full interval."""
    await asyncio.gather(
        *(router.health.check(w) for w in router.pool.workers.values() if w.reason == "not checked yet")
    )
