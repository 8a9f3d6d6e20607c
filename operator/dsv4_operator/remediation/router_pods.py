"""The watchdog's round over a deployment's router pods (issue 45): the I/O around
watchdog.routers (which decides). Each round: the router pods (kopf's pod index, else a LIST), scrape each one's /metrics
(signals kind ROUTER), judge with the engines' detector, and for a wedge newly seen: a Warning
Event with the verdict's evidence, then a restart (the Eviction API, which honours a
PodDisruptionBudget, with the pod's UID as precondition; its ReplicaSet makes a new pod) only
when another replica is ready and answering, else a report. The status field `routers` says
what the watchdog saw of each router pod last round."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import httpx

from dsv4_operator.kube import ApiError, KubeApi, resource_path
from dsv4_operator.manifests import selector_labels
from dsv4_operator.remediation.executor import EventSink
from dsv4_operator.remediation.scrape import scrape_engine
from dsv4_operator.watchdog.detector import Detector, Wedged, verdict_to_dict
from dsv4_operator.watchdog.report import iso
from dsv4_operator.watchdog.routers import RESTART, RouterPod, decide_routers, router_pods
from dsv4_operator.watchdog.signals import ROUTER


class RouterPodsWatch:
    def __init__(
        self,
        api: Callable[[], KubeApi],
        namespace: str,
        name: str,
        events: EventSink,
        source: Optional[Callable[[], list]] = None,
    ) -> None:
        self.api, self.namespace, self.name, self.events = api, namespace, name, events
        self.source = source  # kopf's pod index (one watch for the operator); None: a LIST per round
        self.detector: Optional[Detector] = None
        self.said: dict[str, str] = {}  # pod/uid -> the wedge reason already reported
        self.last_restart: Optional[dict[str, Any]] = None
        self.last_restart_at: Optional[float] = None
        self.http = httpx.AsyncClient()

    async def close(self) -> None:
        await self.http.aclose()

    async def pods(self, port: int) -> list[RouterPod]:
        if self.source is not None:
            return router_pods(list(self.source()), self.name, port)
        sel = ",".join(f"{k}={v}" for k, v in selector_labels(self.name, "router").items())
        doc = await self.api().request(
            "GET", resource_path("v1", "pods", self.namespace), query=[("labelSelector", sel)]
        )
        return router_pods(list((doc or {}).get("items") or []), self.name, port)

    async def round(
        self, port: int, window_s: float, scrape_timeout: float, cooldown_s: float, dry_run: bool, now: float
    ) -> dict[str, Any]:
        """One round; the status field `routers`."""
        if self.detector is None or self.detector.window_s != window_s:
            self.detector = Detector(window_s=window_s)
        pods = await self.pods(port)
        keys = {f"{p.name}/{p.uid}" for p in pods}
        for gone in set(self.detector.pods()) - keys:
            self.detector.forget(gone)  # a deleted or replaced pod: a new one starts afresh
        seen, wedged, answering = [], {}, set()
        for pod in pods:
            if pod.url is None:
                continue
            sample = await scrape_engine(self.http, pod.url, "router", ROUTER, timeout=scrape_timeout)
            verdict = self.detector.observe(f"{pod.name}/{pod.uid}", sample, answered_before=pod.ready)
            seen.append({"pod": pod.name, "ready": pod.ready, **verdict_to_dict(verdict)})
            if isinstance(verdict, Wedged):
                wedged[pod.name] = verdict
            elif sample.reachable:
                answering.add(pod.name)
        steps = decide_routers(
            pods,
            {p: v.reason for p, v in wedged.items()},
            answering,
            now=now,
            last_restart_at=self.last_restart_at,
            cooldown_s=cooldown_s,
            dry_run=dry_run,
        )
        uids = {p.name: p.uid for p in pods}
        for step in steps:
            verdict = wedged[step.pod]
            key = f"{step.pod}/{uids[step.pod]}"
            if self.said.get(key) != verdict.reason:
                self.said[key] = verdict.reason
                self.events(
                    "Warning",
                    "WedgeDetected",
                    f"{step.pod} (router): {verdict.reason} {dict(verdict.details)}; "
                    + ("restarting it: " if step.action == RESTART else "")
                    + step.why,
                )
            if step.action == RESTART:
                result = await self.evict(step.pod, step.uid)
                self.last_restart_at = now
                self.last_restart = {
                    "time": iso(time.time()),
                    "pod": step.pod,
                    "reason": verdict.reason,
                    "evidence": dict(verdict.details),
                    "result": result,
                }
        for key in list(self.said):
            if key.split("/")[0] not in wedged:
                del self.said[key]  # healthy again: a later wedge is said again
        out: dict[str, Any] = {"pods": seen}
        if self.last_restart is not None:
            out["lastRestart"] = self.last_restart
        return out

    async def evict(self, pod: str, uid: str) -> str:
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": pod, "namespace": self.namespace},
            "deleteOptions": {"preconditions": {"uid": uid}},
        }
        try:
            await self.api().request(
                "POST",
                resource_path("v1", "pods", self.namespace, pod, "eviction"),
                body=body,
                content_type="application/json",
            )
        except ApiError as e:
            if e.status in (404, 409):
                return "already gone"
            self.events("Warning", "RouterRestartFailed", f"{pod} (router): eviction refused: {e}")
            return f"eviction refused: {e.status}"
        self.events("Normal", "RouterRestarted", f"{pod} (router): evicted (uid {uid}); its ReplicaSet makes a new one")
        return "evicted"
