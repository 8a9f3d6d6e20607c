"""The planner's shell: a kopf daemon per DSV4Deployment that runs `decision.decide` every
`spec.planner.intervalSeconds` for the roles with `scaling: planner`, and carries out what it says.

Every round:
- read: the engine pods (the operator's pod index), the role's StatefulSet (its replicas, its
  rollout), the watchdog's remediation state and the canary record (annotations of the
  resource), and each engine's /v1/loads and /metrics;
- decide (pure): decision.decide;
- act: a scale-up writes the StatefulSet's replicas (server-side apply of that field alone, the
  field manager `dsv4-operator-scale`, as for a role handed to an autoscaler); a scale-down first
  drains the pods that go — labelled `serving.dsv4.dev/draining=true` (every router drops them),
  annotated as the planner's drain, and asked to drain (`POST /admin/drain`: no new requests, the
  running ones finish) — and writes the lower count once they are idle or drainTimeoutSeconds
  passed; the StatefulSet then deletes them (their preStop drain finds nothing left; what a
  timed-out drain still ran is ended by SIGTERM and moved by the routers' migration);
- post an Event on the resource for every decision that changes something, and for a hold whose
  kind (cool-down, budget, paused, ...) or target changed, each with its numbers.

Only the leader acts (Fleet.may_act, as the watchdog). A restarted operator begins with a fresh
model and forecast, a cool-down before any scale-down, and resumes a drain it finds annotated.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import replace
from typing import Any, Callable, Iterable, Mapping, Optional

import aiohttp

import kopf

from dsv4_wire import ANNOTATION_PLANNER_DRAIN, LABEL_DRAINING, Paths, authorization_header

from dsv4_operator import spec as S
from dsv4_operator.handlers.apply import deployment_admin_token
from dsv4_operator.handlers.registry import CR, _api, _metrics, registry
from dsv4_operator.auth_secret import AuthSecretRefused
from dsv4_operator.bounded import LOADS_MAX_BYTES, METRICS_MAX_BYTES, BodyTooLarge, read_capped
from dsv4_operator.canary.plan import PROBING, CanaryRecord
from dsv4_operator.kube import ApiError, KubeApi, path_of, resource_path
from dsv4_operator.manifests import HOLD_PARTITION, SCALE_MANAGER, Owner, child_name, scale_handover, workload_kind
from dsv4_operator.workload_form import lws_served
from dsv4_operator.planner.decision import (
    DRAIN,
    ROLES,
    SCALE_DOWN,
    SCALE_UP,
    Decision,
    Drain,
    PlannerState,
    RoleObservation,
    Settings,
    decide,
)
from dsv4_operator.planner.observe import BUILTIN, EngineLoad, Reading, engine_load, reading
from dsv4_operator.telemetry import OperatorMetrics
from dsv4_operator.watchdog.pods import EnginePod, engine_pod
from dsv4_operator.watchdog.policy import STATE_ANNOTATION, PolicyState

IDLE_INTERVAL = 10.0  # seconds between looks at a resource with no planned role (or an unreadable spec)
SCRAPE_TIMEOUT = 5.0
EVENT_REASONS = {
    SCALE_UP: "PlannerScaleUp",
    DRAIN: "PlannerDrain",
    SCALE_DOWN: "PlannerScaleDown",
}
HOLD_REASON = "PlannerHold"

Stopped = Any  # kopf.DaemonStopped
EventSink = Callable[[str, str, str], None]
PodSource = Callable[[str, str], Iterable[Mapping[str, Any]]]


# ---- pure helpers ----------------------------------------------------------------------------


def rollout_pause(sts: Optional[Mapping[str, Any]]) -> Optional[str]:
    """Why a role's StatefulSet is in a rollout (its pods are changing template): the planner
    leaves its count alone until it finishes. None when it is settled."""
    if not sts:
        return "its StatefulSet does not exist yet"
    meta, spec, status = sts.get("metadata") or {}, sts.get("spec") or {}, sts.get("status") or {}
    partition = ((spec.get("updateStrategy") or {}).get("rollingUpdate") or {}).get("partition")
    if partition == HOLD_PARTITION:
        return "its pods are held on their template (a rollout of the other role, or a canary)"
    if int(status.get("observedGeneration") or 0) < int(meta.get("generation") or 0):
        return "its StatefulSet controller has not seen the latest change yet"
    if status.get("updateRevision") and status.get("currentRevision") != status.get("updateRevision"):
        return f"a rollout is in progress ({status.get('currentRevision')} -> {status.get('updateRevision')})"
    return None


def canary_pause(annotations: Optional[Mapping[str, str]], role: str) -> Optional[str]:
    """The canary probes a pod of `role` now: the count stays (the canary is the highest ordinal)."""
    record = CanaryRecord.from_annotations(annotations)
    state = record.state if record else None
    if state is not None and state.phase == PROBING and state.role == role:
        return f"the canary {state.pod} is being probed"
    return None


def remediating(annotations: Optional[Mapping[str, str]], role: str) -> tuple[str, ...]:
    """The pods of `role` the watchdog is remediating (its persisted policy state)."""
    try:
        state = PolicyState.from_json((annotations or {}).get(STATE_ANNOTATION))
    except (ValueError, TypeError, KeyError):
        return ()
    return tuple(sorted(pod for pod, rec in state.active.items() if rec.role == role))


def planner_drained(pods: Iterable[Mapping[str, Any]], role: str) -> tuple[str, ...]:
    """Pods of `role` a planner (this one before a restart, or another leader) was draining."""
    out = []
    for obj in pods:
        meta = obj.get("metadata") or {}
        pod = engine_pod(obj)
        if (
            pod is not None
            and pod.role == role
            and pod.draining
            and not pod.terminating
            and (meta.get("annotations") or {}).get(ANNOTATION_PLANNER_DRAIN)
        ):
            out.append(pod.name)
    return tuple(sorted(out))


def ordinal(pod: str) -> int:
    tail = pod.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def resume_drains(
    state: PlannerState, drained: Mapping[str, tuple[str, ...]], replicas: Mapping[str, int], now: float
) -> PlannerState:
    """A drain found annotated on pods but not in the state (the operator restarted): resumed, its
    target the lowest drained ordinal (the StatefulSet keeps the ordinals below it). Pods at or
    past the count are being removed already (a drain that finished): nothing to resume."""
    roles = dict(state.roles)
    for role, found in drained.items():
        rs = state.role(role)
        pods = tuple(p for p in found if ordinal(p) < replicas.get(role, 0))
        if pods and rs.drain is None:
            roles[role] = replace(rs, drain=Drain(pods, min(ordinal(p) for p in pods), now))
    return PlannerState(state.models, roles)


# ---- the daemon ------------------------------------------------------------------------------


class DeploymentPlanner:
    def __init__(
        self,
        api: Callable[[], KubeApi],
        metrics: OperatorMetrics,
        body: Mapping[str, Any],
        events: EventSink,
        logger: logging.Logger | logging.LoggerAdapter,
        *,
        admin_token: Optional[str] = None,
        fleet: Any = None,
        pods: Optional[PodSource] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        meta = body["metadata"]
        self.api, self.metrics, self.body, self.events, self.logger = api, metrics, body, events, logger
        self.namespace, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.headers = authorization_header(admin_token)
        self.fleet, self.pod_source, self.clock = fleet, pods, clock
        self.state = PlannerState()
        self.readings: dict[tuple[str, Optional[str]], Reading] = {}
        self.posted: dict[str, tuple] = {}  # role -> key of the last decision posted as an Event
        self.last: Optional[Decision] = None
        self._http: Optional[aiohttp.ClientSession] = None

    async def run(self, stopped: Stopped) -> None:
        try:
            while not stopped:
                started = time.monotonic()
                interval = IDLE_INTERVAL
                try:
                    interval = await self.tick()
                except ApiError as e:
                    self.metrics.api_errors.labels(str(e.status)).inc()
                    self.logger.warning(f"Planner round failed: {e}")
                except Exception:  # one bad round must not end the planner
                    self.logger.exception("Planner round failed")
                await stopped.wait(max(0.0, interval - (time.monotonic() - started)))
        finally:
            if self._http is not None:
                await self._http.close()

    def _spec(self) -> Optional[S.DSV4DeploymentSpec]:
        try:
            return S.parse_spec(self.body.get("spec"))
        except Exception:  # the reconciler reports an invalid spec (Degraded)
            return None

    async def tick(self) -> float:
        """One round; returns the seconds until the next."""
        spec = self._spec()
        if spec is None or not spec.planned_roles():
            return IDLE_INTERVAL
        if self.fleet is not None and not self.fleet.may_act():
            return IDLE_INTERVAL  # not the leader: the leader plans
        settings = Settings.from_spec(spec)
        now = self.clock()
        annotations = dict(self.body["metadata"].get("annotations") or {})
        raw_pods = list(self.pod_source(self.namespace, self.name)) if self.pod_source else []
        pods = [p for p in (engine_pod(o, spec.engine.port) for o in raw_pods) if p is not None]
        loads = await self._scrape([p for p in pods if p.url and not p.terminating], spec.engine.kind)
        observations: dict[str, RoleObservation] = {}
        drained: dict[str, tuple[str, ...]] = {}
        for role in ROLES:
            sts = await self.api().get("apps/v1", "StatefulSet", self.namespace, child_name(self.name, role))
            role_pods = [p for p in pods if p.role == role and not p.terminating]
            replicas = int(((sts or {}).get("spec") or {}).get("replicas") or 0)
            planned = spec.role(role).scaling == "planner"
            observations[role] = RoleObservation(
                role=role,
                replicas=replicas,
                statefulset=child_name(self.name, role),
                engines=tuple(loads[p.name] for p in role_pods if p.name in loads),
                ready=sum(1 for p in role_pods if p.ready and not p.draining),
                paused=(rollout_pause(sts) or canary_pause(annotations, role)) if planned else None,
                remediating=remediating(annotations, role),
                planned=planned and sts is not None,
            )
            drained[role] = planner_drained(raw_pods, role)
        self.state = resume_drains(self.state, drained, {r: o.replicas for r, o in observations.items()}, now)
        decision = decide(observations, self.state, settings, now)
        self.state = decision.state
        self.last = decision
        for role, d in decision.roles.items():
            self.metrics.planner_target.labels(self.namespace, self.name, role).set(d.target)
            if d.changes:
                self.metrics.planner_decisions.labels(role, d.action).inc()
            if not d.dry_run:
                if d.action in (SCALE_UP, SCALE_DOWN) and d.target != observations[role].replicas:
                    await self._scale(role, d.target)
                elif d.action == DRAIN:
                    await self._drain([p for p in pods if p.name in d.drain])
            if (d.changes and not d.dry_run) or self.posted.get(role) != d.key:
                self.events(
                    "Normal",
                    EVENT_REASONS.get(d.action, HOLD_REASON) if not d.dry_run else HOLD_REASON,
                    d.message(),
                )
                self.posted[role] = d.key
        return settings.interval_s

    # ---- reads ----------------------------------------------------------------------------------

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            # the admin token on every call: /v1/loads answers it alone (it lists requests)
            self._http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT), trust_env=False, headers=self.headers
            )
        return self._http

    async def _get(self, url: str, limit: int) -> Optional[str]:
        try:
            async with self._session().get(url) as resp:
                if resp.status != 200:
                    return None
                return (await read_capped(resp, limit)).decode("utf-8", "replace")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, BodyTooLarge):
            return None

    async def _scrape(self, pods: list[EnginePod], kind: str) -> dict[str, EngineLoad]:
        async def one(pod: EnginePod) -> tuple[EnginePod, Optional[str], Optional[str], float]:
            assert pod.url is not None
            loads_path = Paths.LOADS + ("?include=disagg" if kind != BUILTIN else "")
            sent = self.clock()
            loads, metrics = await asyncio.gather(
                self._get(pod.url + loads_path, LOADS_MAX_BYTES), self._get(pod.url + Paths.METRICS, METRICS_MAX_BYTES)
            )
            # the engine read its counters somewhere between sending and answering: the midpoint
            # (a slow answer would otherwise shorten or stretch the interval its rates are over)
            return pod, loads, metrics, (sent + self.clock()) / 2

        out: dict[str, EngineLoad] = {}
        seen: set[tuple[str, Optional[str]]] = set()
        for pod, loads_text, metrics_text, stamp in await asyncio.gather(*(one(p) for p in pods)):
            if loads_text is None and metrics_text is None:
                continue  # silent: the watchdog judges that; the planner plans with those that answer
            try:
                loads = json.loads(loads_text) if loads_text else None
            except ValueError:
                loads = None
            key = (pod.name, pod.uid)
            now = reading(stamp, loads, metrics_text, kind)
            out[pod.name] = engine_load(
                pod.name, pod.role, self.readings.get(key), now, ready=pod.ready, draining=pod.draining
            )
            self.readings[key] = now
            seen.add(key)
        for key in [k for k in self.readings if k not in seen and k[0] not in {p.name for p in pods}]:
            del self.readings[key]  # pods that went away
        return out

    # ---- writes ---------------------------------------------------------------------------------

    async def _scale(self, role: str, replicas: int) -> None:
        """The StatefulSet's replicas alone, by server-side apply under SCALE_MANAGER (the field
        manager of a role whose count is not the spec's), forced: the planner owns the count."""
        spec = self._spec()
        # A multi-node role on a cluster with LeaderWorkerSet: its LeaderWorkerSet's groups.
        kind = workload_kind(spec, role, await lws_served(self.api())) if spec is not None else None
        manifest = scale_handover(Owner(self.name, self.namespace, self.uid), role, replicas, *([kind] if kind else []))
        await self.api().request(
            "PATCH",
            path_of(manifest),
            body=manifest,
            content_type="application/apply-patch+yaml",
            query=[("fieldManager", SCALE_MANAGER), ("force", "true")],
        )
        self.logger.info(f"Planner: {role} replicas -> {replicas}")

    async def _drain(self, pods: list[EnginePod]) -> None:
        """Out of every router (the draining label), marked as the planner's drain, and asked to
        drain (no new requests; the running ones finish). Each write names the pod's UID: a pod
        replaced meanwhile is left alone."""
        for pod in pods:
            patch = [
                {"op": "test", "path": "/metadata/uid", "value": pod.uid},
                {"op": "add", "path": "/metadata/labels/" + _escape(LABEL_DRAINING), "value": "true"},
            ]
            live = await self.api().get("v1", "Pod", self.namespace, pod.name)
            if live is not None and not (live["metadata"].get("annotations")):
                patch.append({"op": "add", "path": "/metadata/annotations", "value": {}})
            patch.append(
                {
                    "op": "add",
                    "path": "/metadata/annotations/" + _escape(ANNOTATION_PLANNER_DRAIN),
                    "value": "scale-down",
                }
            )
            try:
                await self.api().request(
                    "PATCH",
                    resource_path("v1", "pods", self.namespace, pod.name),
                    body=patch,
                    content_type="application/json-patch+json",
                )
            except ApiError as e:
                if e.status not in (404, 409, 422):
                    raise
                continue  # gone or replaced
            if pod.url:
                try:
                    async with self._session().post(pod.url + Paths.ADMIN_DRAIN) as resp:
                        if resp.status >= 400:
                            self.logger.warning(f"Planner: drain of {pod.name} answered {resp.status}")
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                    self.logger.warning(f"Planner: drain of {pod.name} failed: {e}")


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


# ---- the kopf daemon ----------------------------------------------------------------------------


@kopf.daemon(*CR, id="planner", registry=registry, cancellation_backoff=1.0, cancellation_timeout=10.0)
async def planner_daemon(
    stopped: kopf.DaemonStopped, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, dsv4_pods: kopf.Index, **_: Any
) -> None:
    """Plan this deployment's planned roles for as long as it exists (idle while it has none).
    `body` is kopf's live view of the resource: spec edits reach the running loop."""

    def post(type_: str, reason: str, message: str) -> None:
        kopf.event(body, type=type_, reason=reason, message=message)

    def pods(namespace: str, instance: str) -> list:
        return list(dsv4_pods.get((namespace, instance), []))

    def planned() -> bool:
        try:
            return bool(S.parse_spec(body.get("spec")).planned_roles())
        except Exception:
            return False

    admin_token, attempt = None, 0
    while admin_token is None and not stopped:
        if not planned():
            await stopped.wait(IDLE_INTERVAL)
            continue
        try:
            admin_token = await deployment_admin_token(
                _api(memo), body["metadata"]["namespace"], body["metadata"]["name"]
            )
        except (ApiError, kopf.TemporaryError, AuthSecretRefused) as e:
            logger.warning(f"Planner: cannot read the deployment's admin token yet: {e}")
        if admin_token is None:
            await stopped.wait(min(2.0 * 2**attempt, 60.0))
            attempt += 1
    if stopped:
        return
    planner = DeploymentPlanner(
        lambda: _api(memo),
        _metrics(memo),
        body,
        post,
        logger,
        admin_token=admin_token,
        fleet=getattr(memo, "fleet", None),
        pods=pods,
    )
    await planner.run(stopped)
