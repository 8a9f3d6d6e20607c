"""Kubernetes discovery for the router: engine pods found by label selector, kept in sync by a
watch. A pod serves traffic while it is Running with an IP, not being deleted, and not
labelled serving.dsv4.dev/draining=true (how the operator drains a wedged pod). With `owners`
(--owner, which the operator always passes) it must also be controlled by one of those
StatefulSets: labels alone can be copied onto any pod, and a worker gets user traffic and the
PD secret."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Mapping, Optional, Sequence

from dsv4_wire import LABEL_DRAINING, LABEL_ROLE, owned_engine_pod

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


def sync(router, pods: Mapping[str, Mapping]) -> None:
    """Make the router's Kubernetes-sourced workers exactly the serving pods given."""
    owners = getattr(router.args, "owners", None) or ()
    wanted = {w for w in (pod_worker(p, owners) for p in pods.values()) if w is not None}
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
