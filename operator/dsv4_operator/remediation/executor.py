"""Carries out the policy's actions on Kubernetes: the twin of `dsv4_operator.local.up.LocalExecutor`.
What each action asks of the engine (paths, bodies, evidence) is the shared table of
`dsv4_operator.remediation.actions`; this module adds the cluster's side:

- capture evidence: the table's fetches, the pod's last log lines (pods/log), the spec diff
  since the stable revision -> a ConfigMap labelled `serving.dsv4.dev/evidence=true`, owned by
  the DSV4Deployment; only the newest ``evidence_kept`` of a deployment are kept;
- drain: label the pod `serving.dsv4.dev/draining=true` (the router drops it), then the table's
  engine calls;
- abort: the table's engine calls;
- restart: evict the pod (policy/v1 Eviction: PodDisruptionBudgets hold it, 429 = retry later)
  with a UID precondition (its StatefulSet recreates it).

Every step acts only on the incarnation the policy judged (the action's UID): a step replayed
after an operator restart never touches the pod's replacement. Steps before the restart are best
effort — a dead engine answers nothing, yet must still be restarted — so they report what failed
in a note rather than failing. Each step is an Event on the resource and a metric.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import aiohttp

from dsv4_wire import ENGINE_CONTAINER, authorization_header

from dsv4_operator import spec as S
from dsv4_operator.bounded import EVIDENCE_MAX_BYTES, LOG_MAX_BYTES, BodyTooLarge, read_capped
from dsv4_operator.kube import ApiError, KubeApi, resource_path
from dsv4_operator.remediation.actions import Step, dispatch, step_for
from dsv4_operator.watchdog.pods import DRAINING_LABEL, EnginePod
from dsv4_operator.watchdog.report import hold_message, wedge_message
from dsv4_operator.telemetry import OperatorMetrics
from dsv4_operator.watchdog.detector import Verdict, verdict_to_dict
from dsv4_operator.watchdog.evidence import DEPLOYMENT_LABEL, EVIDENCE_LABEL, build_evidence_configmap
from dsv4_operator.watchdog.policy import STEPS, Action

EventSink = Callable[[str, str, str], None]  # (type, reason, message)
LOG_LINES = 200
EVIDENCE_KEPT = 20  # per deployment: the newest evidence ConfigMaps; older ones are deleted
CAPTURED_AT = "serving.dsv4.dev/captured-at"


def evicted_by_budget(message: Optional[str]) -> bool:
    """Pure: a 429 from the Eviction API is a PodDisruptionBudget's ("Cannot evict pod as it would
    violate the pod's disruption budget") or the API server shedding load (API Priority and
    Fairness: "Too many requests, please try again later")."""
    return "disruption budget" in (message or "").lower()


@dataclass
class DeploymentContext:
    """What the executor knows of the deployment, refreshed by the daemon every round."""

    namespace: str
    name: str
    uid: str
    kind: str = "builtin"
    pods: dict[str, EnginePod] = field(default_factory=dict)
    members: dict[str, list[EnginePod]] = field(default_factory=dict)  # a group's leader -> its workers
    spec_diff: Sequence[str] | str = "(no spec history yet)"
    revision: Optional[str] = None

    def owner_reference(self) -> dict[str, Any]:
        # Not a controller reference and no blockOwnerDeletion: evidence only has to go when
        # the resource goes, and creating it then needs no rights on the resource's finalizers.
        return {"apiVersion": S.API_VERSION, "kind": S.KIND, "name": self.name, "uid": self.uid}


class KubernetesExecutor:
    def __init__(
        self,
        api: Callable[[], KubeApi],
        context: DeploymentContext,
        events: EventSink,
        metrics: OperatorMetrics,
        *,
        admin_token: Optional[str] = None,
        http_timeout: float = 5.0,
        log_lines: int = LOG_LINES,
        evidence_kept: int = EVIDENCE_KEPT,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.api = api
        self.ctx = context
        self.events = events
        self.metrics = metrics
        self.http_timeout = http_timeout
        self.log_lines = log_lines
        self.evidence_kept = max(int(evidence_kept), 1)
        self.clock = clock
        self.headers = authorization_header(admin_token)
        self.evidence: dict[str, str] = {}  # pod -> name of its latest evidence ConfigMap
        self.blocked: dict[str, Optional[str]] = {}  # pod -> uid whose eviction a PDB blocked (said once)
        self._http: Optional[aiohttp.ClientSession] = None

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    # ---- the Executor protocol of dsv4_operator.remediation.runner -------------------------------

    async def run(self, action: Action, verdict: Optional[Verdict]) -> tuple[bool, Optional[str]]:
        ok, note = await dispatch(self, action, verdict)
        if action.kind in STEPS:
            self.metrics.remediations.labels(action.kind, action.role, "ok" if ok else "failed").inc()
        return ok, note

    @property
    def engine_kind(self) -> str:
        return self.ctx.kind

    async def report(self, action: Action, verdict: Optional[Verdict]) -> tuple[bool, Optional[str]]:
        self.events("Warning", step_for(action.kind, self.engine_kind).event, wedge_message(action))
        self.metrics.wedges_detected.labels(action.role, action.reason).inc()
        return True, None

    async def held(self, action: Action, verdict: Optional[Verdict]) -> tuple[bool, Optional[str]]:
        self.events("Warning", step_for(action.kind, self.engine_kind).event, hold_message(action))
        self.metrics.remediations.labels("held", action.role, action.reason).inc()
        return True, None

    # ---- steps ----------------------------------------------------------------------------------

    def _current(self, action: Action) -> tuple[Optional[EnginePod], Optional[str]]:
        """The pod the action is about, or why it is not there any more."""
        pod = self.ctx.pods.get(action.pod)
        if pod is None:
            return None, "pod is gone"
        if action.uid and pod.uid and pod.uid != action.uid:
            return None, f"pod was replaced (uid {pod.uid}, not {action.uid})"
        return pod, None

    async def capture(self, action: Action, verdict: Optional[Verdict]) -> tuple[bool, Optional[str]]:
        """Evidence of the wedged engine; of a multi-node engine, of every pod of its group (its
        workers' node agents answer stacks, loads and metrics; each pod's log): one ConfigMap each."""
        pod, gone = self._current(action)
        ok, note = await self._capture_pod(action, verdict, action.pod, pod, gone)
        for worker in self.ctx.members.get(action.pod, []):
            w_ok, w_note = await self._capture_pod(action, verdict, worker.name, worker, None, group=action.pod)
            ok = ok and w_ok
            if w_note:
                note = f"{note}; {worker.name}: {w_note}" if note else f"{worker.name}: {w_note}"
        return ok, note

    async def _capture_pod(
        self,
        action: Action,
        verdict: Optional[Verdict],
        pod_name: str,
        pod: Optional[EnginePod],
        gone: Optional[str],
        group: Optional[str] = None,
    ) -> tuple[bool, Optional[str]]:
        step = step_for(action.kind, self.engine_kind)
        missing: list[str] = []
        url = pod.url if pod else None

        async def fetch(path: Optional[str], what: str) -> Optional[str]:
            if path is None:
                missing.append(f"{what} (the engine has no such endpoint)")
                return None
            if url is None:
                missing.append(f"{what} ({gone or 'no pod IP'})")
                return None
            text, err = await self._http_text("GET", url + path)
            if err:
                missing.append(f"{what} ({err})")
            return text

        *fetched, logs = await asyncio.gather(
            *(fetch(path, what) for what, path in step.fetch), self._pod_log(pod_name, missing)
        )
        got = dict(zip((what for what, _ in step.fetch), fetched))
        stacks, loads_text, metrics_text = got.get("stacks"), got.get("loads"), got.get("metrics")
        loads: Any = loads_text
        if loads_text:
            try:
                loads = json.loads(loads_text)
            except ValueError:
                pass
        verdict_doc = (
            verdict_to_dict(verdict)
            if verdict is not None
            else {
                # Resumed after an operator restart: the detector's window is gone, the policy's
                # record of why is not.
                "state": "Wedged",
                "reason": action.reason,
                "details": dict(action.details),
                "resumed": True,
            }
        )
        if group is not None:  # a worker of the wedged group: the group's verdict, and which pod this is
            verdict_doc = {**verdict_doc, "group": group, "node": pod.node if pod else None}
        now = self.clock()
        cm = build_evidence_configmap(
            deployment=self.ctx.name,
            namespace=self.ctx.namespace,
            pod=pod_name,
            role=action.role,
            captured_at=now,
            verdict=verdict_doc,
            stacks=stacks,
            loads=loads,
            metrics=metrics_text,
            logs=logs,
            spec_diff=self.ctx.spec_diff,
            revision=self.ctx.revision,
            owner_references=[self.ctx.owner_reference()],
        )
        name = cm["metadata"]["name"]
        try:
            await self.api().request(
                "POST", resource_path("v1", "configmaps", self.ctx.namespace), body=cm, content_type="application/json"
            )
        except ApiError as e:
            if e.status != 409:  # 409: this very capture was written already (a replayed step)
                return False, f"evidence ConfigMap {name} not written: {e}"
        self.evidence[pod_name] = name
        notes = [f"not captured: {'; '.join(missing)}"] if missing else []
        pruned = await self._prune_evidence(cm["metadata"]["labels"][DEPLOYMENT_LABEL])
        if pruned:
            notes.append(pruned)
        note = "; ".join(notes) or None
        self.events(
            "Normal",
            step.event,
            f"{pod_name} ({action.role}{f', group {group}' if group else ''}): ConfigMap {name}"
            + (f"; {note}" if note else ""),
        )
        return True, note

    async def drain(self, action: Action, verdict: Optional[Verdict]) -> tuple[bool, Optional[str]]:
        pod, gone = self._current(action)
        if pod is None:
            return True, gone
        # A JSON patch whose first operation tests the UID: the label lands on this incarnation
        # or nowhere (a replacement pod must not leave the router for good).
        patch = [
            {"op": "test", "path": "/metadata/uid", "value": action.uid or pod.uid},
            {
                "op": "add",
                "path": "/metadata/labels/" + DRAINING_LABEL.replace("~", "~0").replace("/", "~1"),
                "value": "true",
            },
        ]
        try:
            await self.api().request(
                "PATCH",
                resource_path("v1", "pods", self.ctx.namespace, action.pod),
                body=patch,
                content_type="application/json-patch+json",
            )
        except ApiError as e:
            if e.status in (404, 409, 422):  # gone, or not the same pod any more
                return True, f"not labelled: {e}"
            return False, f"labelling failed: {e}"
        step = step_for(action.kind, self.engine_kind)
        errors = await self._engine_calls(pod.url, step) if pod.url else []
        note = f"engine drain: {'; '.join(errors)}" if errors else None
        self.events(
            "Normal",
            step.event,
            f"{action.pod} ({action.role}): labelled {DRAINING_LABEL}=true, out of "
            f"the router" + (f"; {note}" if note else ""),
        )
        return True, note

    async def abort(self, action: Action, verdict: Optional[Verdict]) -> tuple[bool, Optional[str]]:
        pod, gone = self._current(action)
        if pod is None or not pod.url:
            return True, gone or "no pod IP"
        step = step_for(action.kind, self.engine_kind)
        err = "; ".join(await self._engine_calls(pod.url, step)) or None
        self.events(
            "Normal",
            step.event,
            f"{action.pod} ({action.role}): " + (f"abort failed: {err}" if err else "aborted every request it held"),
        )
        return True, f"abort: {err}" if err else None

    async def restart(self, action: Action, verdict: Optional[Verdict]) -> tuple[bool, Optional[str]]:
        """Evict the pod (policy/v1 Eviction, which honours PodDisruptionBudgets) with a UID
        precondition; its StatefulSet recreates it. A PDB that allows no disruption now answers
        429: the restart stays pending and is retried next round (an Event says so once)."""
        body: dict[str, Any] = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": action.pod, "namespace": self.ctx.namespace},
        }
        if action.uid:
            body["deleteOptions"] = {"preconditions": {"uid": action.uid}}
        try:
            await self.api().request(
                "POST",
                resource_path("v1", "pods", self.ctx.namespace, action.pod, "eviction"),
                body=body,
                content_type="application/json",
            )
        except ApiError as e:
            if e.status == 404:
                return True, "already gone"
            if e.status == 409:  # the UID precondition failed: this incarnation is gone already
                return True, "already replaced"
            if e.status == 429 and not evicted_by_budget(e.message):
                # API Priority and Fairness shedding load, not a budget: say so, retry next round.
                self.metrics.remediations.labels("eviction_throttled", action.role, action.reason).inc()
                return False, f"eviction throttled by the API server (429, not a PodDisruptionBudget): {e.message}"
            if e.status == 429:
                note = f"eviction blocked by a PodDisruptionBudget: {e.message or e.reason}"
                if self.blocked.get(action.pod) != action.uid:
                    self.blocked[action.pod] = action.uid
                    self.events(
                        "Warning",
                        "EvictionBlocked",
                        f"{action.pod} ({action.role}): {note}; retried every round until the budget allows it",
                    )
                self.metrics.remediations.labels("eviction_blocked", action.role, action.reason).inc()
                return False, note
            return False, f"eviction failed: {e}"
        self.blocked.pop(action.pod, None)
        self.events(
            "Normal",
            step_for(action.kind, self.engine_kind).event,
            f"{action.pod} ({action.role}): evicted (uid {action.uid}); "
            + (
                "its group is made anew, every pod of it"
                if (self.ctx.pods.get(action.pod) and self.ctx.pods[action.pod].group_size > 1)
                else "its StatefulSet recreates it"
            ),
        )
        return True, None

    # ---- I/O helpers ----------------------------------------------------------------------------

    async def _engine_calls(self, url: str, step: Step) -> list[str]:
        """The step's admin calls on the engine at ``url``, in order; what went wrong, if anything."""
        errors = []
        for call in step.calls:
            _, err = await self._http_text(
                call.method, url + call.path, body=dict(call.body) if call.body is not None else None
            )
            if err:
                errors.append(err)
        return errors

    async def _http_text(self, method: str, url: str, body: Any = None) -> tuple[Optional[str], Optional[str]]:
        if self._http is None:
            self._http = aiohttp.ClientSession(trust_env=False, headers=self.headers)
        try:
            async with self._http.request(
                method, url, json=body, timeout=aiohttp.ClientTimeout(total=self.http_timeout)
            ) as resp:
                text = (await read_capped(resp, EVIDENCE_MAX_BYTES)).decode("utf-8", "replace")
                if resp.status >= 400:
                    return None, f"HTTP {resp.status} from {url}: {text[:200]}"
                return text, None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, BodyTooLarge) as e:
            return None, f"{url}: {type(e).__name__}{': ' + str(e) if str(e) else ''}"

    async def _prune_evidence(self, deployment_label: str) -> Optional[str]:
        """Delete the deployment's evidence beyond the newest ``evidence_kept``; best effort
        (returns what went wrong, if anything)."""
        api = self.api()
        selector = f"{EVIDENCE_LABEL}=true,{DEPLOYMENT_LABEL}={deployment_label}"
        try:
            doc = await api.request(
                "GET", resource_path("v1", "configmaps", self.ctx.namespace), query=[("labelSelector", selector)]
            )
            # By the API server's creation time: an annotation anyone who may edit ConfigMaps can
            # forge (a far-future captured-at kept a planted map forever).
            items = sorted(
                (doc or {}).get("items") or [],
                key=lambda cm: (cm["metadata"].get("creationTimestamp", ""), cm["metadata"]["name"]),
            )
            for old in items[: -self.evidence_kept]:
                try:
                    await api.request(
                        "DELETE", resource_path("v1", "configmaps", self.ctx.namespace, old["metadata"]["name"])
                    )
                except ApiError as e:
                    if e.status != 404:
                        raise
        except ApiError as e:
            return f"old evidence not pruned ({e})"
        return None

    async def _pod_log(self, pod: str, missing: list[str]) -> str:
        path = resource_path("v1", "pods", self.ctx.namespace, pod, "log")
        try:
            # The engine container by name: with a sidecar (a mesh proxy, a log shipper) a pods/log
            # read without container= is a 400.
            text = await self.api().get_text(
                path,
                [
                    ("container", ENGINE_CONTAINER),
                    ("tailLines", str(self.log_lines)),
                    ("limitBytes", str(LOG_MAX_BYTES)),
                ],
                limit=LOG_MAX_BYTES,
            )
        except ApiError as e:
            missing.append(f"logs ({e})")
            return f"(pod logs unavailable: {e})\n"
        if _is_pod_object(text):
            # An API server (or emulator) that answers pods/log with the Pod object serves no logs.
            missing.append("logs (the API server serves no pod logs)")
            return "(pod logs unavailable: the API server answered pods/log without log text)\n"
        return text


def _is_pod_object(text: str) -> bool:
    if not text.lstrip().startswith("{"):
        return False
    try:
        doc = json.loads(text)
    except ValueError:
        return False  # log lines, even JSON ones: more than one document
    return isinstance(doc, dict) and doc.get("kind") == "Pod" and "metadata" in doc
