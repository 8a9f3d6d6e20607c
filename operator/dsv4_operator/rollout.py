"""The canary daemon: one per DSV4Deployment, a thin shell around canary.plan (which decides) and
canary.probe / canary.verdict (which measure and judge).

Each tick it reads the resource as kopf sees it and asks `plan.next_step`:
- baseline: record the spec as what the fleet runs (first sight, or a change with nothing to probe);
- probe: the reconciler has moved one decode pod (see plan.effective); wait until that pod runs the
  new template and is ready, take it out of the routers' rotation (their canary flag), run the
  probe against a stable decode pod and then the canary, both pinned through a router, and judge;
  pass: the baseline becomes this spec (the reconciler rolls the rest); fail: an evidence
  ConfigMap, the failed state (the reconciler builds from the baseline again, status says
  Degraded=CanaryFailed). The spec is never written.
Every step leaves an Event. Writing the record (an annotation) makes the reconciler re-apply
(handlers.apply.pin_changed)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Optional

import httpx
import kopf

from dsv4_wire import Paths, authorization_header, controller_of

from dsv4_operator import spec as S
from dsv4_operator.canary import plan
from dsv4_operator.canary.conversation import ConversationShape
from dsv4_operator.canary.probe import ProbeSettings, run_probe
from dsv4_operator.canary.verdict import CanaryThresholds, CanaryVerdict, judge
from dsv4_operator.handlers.apply import check_spec, deployment_tokens
from dsv4_operator.handlers.registry import CR, _api, _metrics, registry
from dsv4_operator.kube import ApiError, KubeApi, resource_path
from dsv4_operator.manifests import (
    ADMIN_TOKEN_KEY,
    HTTP_PORT_NAME,
    ROUTER_ADMIN_TOKEN_KEY,
    Owner,
    child_name,
    contains,
    engine_statefulset,
    multi_node,
    selector_labels,
    workload_kind,
)
from dsv4_operator.pinning import pinned_revision
from dsv4_operator.rollout_hold import hold_reason, renew_hold
from dsv4_operator.watchdog.pods import engine_pod
from dsv4_operator.workload_form import lws_served
from dsv4_operator.watchdog.evidence import DEPLOYMENT_LABEL, EVIDENCE_LABEL

TICK_SECONDS = 1.0
REVISION_LABEL = "controller-revision-hash"  # set by the StatefulSet controller on every pod


def probe_settings(c: S.CanarySpec) -> ProbeSettings:
    shape = ConversationShape(growth_tokens=c.growth_tokens, max_rounds=c.rounds, context_share=c.context_share)
    return ProbeSettings(
        shape=shape,
        concurrency=c.concurrency,
        duration_s=float(c.duration_seconds),
        request_timeout_s=float(c.request_timeout_seconds),
        settle_s=min(10.0, float(c.request_timeout_seconds)),
    )


def thresholds(c: S.CanarySpec) -> CanaryThresholds:
    return CanaryThresholds(max_ttft_ratio=c.max_ttft_ratio, max_itl_ratio=c.max_itl_ratio)


def pod_on_template(pod: Optional[dict], sts: Optional[dict], wanted_template: dict) -> bool:
    """Pure: the pod runs the StatefulSet's latest template, and that template is the wanted one."""
    if not pod or not sts:
        return False
    st, meta = sts.get("status") or {}, sts.get("metadata") or {}
    return (
        contains((sts.get("spec") or {}).get("template"), wanted_template)
        and int(st.get("observedGeneration") or 0) >= int(meta.get("generation") or 0)
        and bool(st.get("updateRevision"))
        and ((pod.get("metadata") or {}).get("labels") or {}).get(REVISION_LABEL) == st.get("updateRevision")
    )


def router_urls(pods: list[dict], port: int, deployment: str) -> list[str]:
    """Pure: http://ip:port of every ready router pod of the deployment: controlled by a ReplicaSet
    of its router Deployment (labels alone can be put on any pod, and these calls carry the admin
    token)."""
    out = []
    for pod in pods:
        status, meta = pod.get("status") or {}, pod.get("metadata") or {}
        kind, name = controller_of(meta) or ("", "")
        if kind != "ReplicaSet" or not name.startswith(child_name(deployment, "router") + "-"):
            continue
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        if ready and status.get("podIP") and not meta.get("deletionTimestamp"):
            p = port
            for c in (pod.get("spec") or {}).get("containers") or []:
                for cp in c.get("ports") or []:
                    if cp.get("name") == HTTP_PORT_NAME:
                        p = int(cp["containerPort"])
            out.append(f"http://{status['podIP']}:{p}")
    return sorted(out)


class CanaryFailure(Exception):
    """The canary cannot be judged a pass (it never became ready, no router to reach it)."""


class CanaryRun:
    """One deployment's canary daemon state between ticks."""

    def __init__(self, body: kopf.Body, api: KubeApi, post: Any, logger: Any, metrics: Any) -> None:
        self.body, self.api, self.post, self.logger, self.metrics = body, api, post, logger, metrics
        self.skipped: set[str] = set()  # revisions whose skip was already said

    @property
    def name(self) -> str:
        return self.body["metadata"]["name"]

    @property
    def namespace(self) -> str:
        return self.body["metadata"]["namespace"]

    def current(self) -> tuple[Optional[S.DSV4DeploymentSpec], dict, dict]:
        meta = self.body.get("metadata") or {}
        raw = dict(self.body.get("spec") or {})
        spec, _ = check_spec(self.name, raw)
        return spec, raw, dict(meta.get("annotations") or {})

    async def write(self, record: plan.CanaryRecord) -> None:
        path = resource_path(S.API_VERSION, S.PLURAL, self.namespace, self.name)
        await self.api.request(
            "PATCH",
            path,
            body={"metadata": {"annotations": {plan.ANNOTATION_CANARY: record.to_annotation()}}},
            content_type="application/merge-patch+json",
        )

    async def tick(self) -> None:
        spec, raw, annotations = self.current()
        if spec is None or (self.body.get("metadata") or {}).get("deletionTimestamp"):
            return
        try:
            await self.hold_routers(spec)
        except (ApiError, httpx.HTTPError) as e:  # the routers hold by themselves a while; the canary goes on
            self.logger.warning(f"Router hold not renewed: {e}")
        if pinned_revision(annotations, int(self.body["metadata"].get("generation") or 0)):
            return  # a rollback pin rules the children: no canary under it
        record = plan.CanaryRecord.from_annotations(annotations)
        step = plan.next_step(record, self.name, spec, raw, await self.live_replicas(spec))
        if step.action == "baseline":
            await self.write(plan.with_baseline(record, raw))
        elif step.action == "skip":
            revision = plan.serving_revision(raw)
            if revision not in self.skipped:
                self.skipped.add(revision)
                self.post("Normal", "CanarySkipped", step.reason)
            await self.write(plan.with_baseline(record, raw))
        elif step.action == "probe":
            assert record is not None and step.state is not None
            await self.probe(spec, raw, record, step.state)

    async def hold_routers(self, spec: S.DSV4DeploymentSpec) -> None:
        """While a one-replica role rolls, the routers hold new requests (rollout_hold.py)."""
        if spec.engine.kind == "sglang" or any(multi_node(spec, r) for r in ("prefill", "decode")):
            return  # sgl-router has no hold; a multi-node role is not one StatefulSet
        reason = hold_reason(
            {
                role: await self.api.get("apps/v1", "StatefulSet", self.namespace, child_name(self.name, role))
                for role in ("prefill", "decode")
            }
        )
        if reason is None:
            return
        sel = ",".join(f"{k}={v}" for k, v in selector_labels(self.name, "router").items())
        listed = await self.api.request(
            "GET", resource_path("v1", "pods", self.namespace), query=[("labelSelector", sel)]
        )
        routers = router_urls(list((listed or {}).get("items") or []), spec.router.port, self.name)
        if routers:
            tokens = await deployment_tokens(self.api, self.namespace, self.name) or {}
            await renew_hold(routers, tokens.get(ROUTER_ADMIN_TOKEN_KEY), reason, self.logger)

    async def live_replicas(self, spec: S.DSV4DeploymentSpec) -> dict[str, int]:
        """The replicas of the engine roles whose count the planner or an autoscaler sets, read from
        their workloads (a role whose workload is not there yet is left out)."""
        out: dict[str, int] = {}
        for role in ("prefill", "decode"):
            if not spec.replicas_from_workload(role):
                continue
            api_version, kind = workload_kind(spec, role, await lws_served(self.api))
            live = await self.api.get(api_version, kind, self.namespace, child_name(self.name, role))
            if live is not None:
                out[role] = int((live.get("spec") or {}).get("replicas") or 0)
        return out

    async def probe(
        self, spec: S.DSV4DeploymentSpec, raw: dict, record: plan.CanaryRecord, state: plan.CanaryState
    ) -> None:
        c = spec.rollout.canary
        if record.state != state:  # first tick of this canary
            record = plan.with_state(record, state)
            await self.write(record)
            self.post(
                "Normal",
                "CanaryStarted",
                f"revision {state.revision}: {state.pod} moves to it first and is "
                f"probed; the rest stay on {state.stable_revision}",
            )
        started = time.monotonic()
        try:
            verdict, urls = await self.measure(spec, raw, state, c)
        except CanaryFailure as e:
            verdict, urls = CanaryVerdict(False, (str(e),)), {}
        except _Superseded:
            return  # the spec moved on: the next tick starts over
        self.metrics.canary_probe_seconds.observe(time.monotonic() - started)
        self.metrics.canary_verdicts.labels("passed" if verdict.passed else "failed").inc()
        if plan.serving_revision(dict(self.body.get("spec") or {})) != state.revision:
            return  # edited while probing: that verdict is for a spec no longer asked for
        figures = {
            "canary": verdict.canary,
            "stable": verdict.stable,
            "probeSeconds": round(time.monotonic() - started, 3),
        }
        if verdict.passed:
            await self.set_canary_flag(urls, False)
            done = plan.CanaryState(
                **{**state.to_dict(), "phase": plan.PASSED, "figures": figures, "summary": verdict.summary()}
            )
            await self.write(plan.with_baseline(record, raw, done))
            self.post(
                "Normal",
                "CanaryPassed",
                f"revision {state.revision}: {state.pod} passed its probe ({_brief(verdict)}); the rollout continues",
            )
            return
        evidence = await self.evidence(state, verdict, figures)
        failed = plan.CanaryState(
            **{
                **state.to_dict(),
                "phase": plan.FAILED,
                "figures": figures,
                "summary": verdict.summary(),
                "evidence": evidence,
            }
        )
        await self.write(plan.with_state(record, failed))
        self.post(
            "Warning",
            "CanaryFailed",
            f"revision {state.revision}: {state.pod} failed its probe: "
            f"{verdict.summary()}; it goes back to {state.stable_revision}, the "
            f"spec is untouched" + (f"; evidence: ConfigMap {evidence}" if evidence else ""),
        )

    async def wait_for(self, what: str, check: Any, timeout: float, revision: str) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            if plan.serving_revision(dict(self.body.get("spec") or {})) != revision:
                raise _Superseded()
            found = await check()
            if found:
                return found
            if time.monotonic() >= deadline:
                raise CanaryFailure(f"{what} within {timeout:.0f} s")
            await asyncio.sleep(TICK_SECONDS)

    async def measure(
        self, spec: S.DSV4DeploymentSpec, raw: dict, state: plan.CanaryState, c: S.CanarySpec
    ) -> tuple[CanaryVerdict, dict]:
        owner = Owner(self.name, self.namespace, self.body["metadata"].get("uid", ""))
        wanted = engine_statefulset(spec, owner, state.role)["spec"]["template"]
        sts_name = child_name(self.name, state.role)

        async def canary_ready() -> Optional[dict]:
            pod = await self.api.get("v1", "Pod", self.namespace, state.pod)
            sts = await self.api.get("apps/v1", "StatefulSet", self.namespace, sts_name)
            ep = engine_pod(pod or {}, spec.engine.port)
            return pod if pod_on_template(pod, sts, wanted) and ep is not None and ep.ready and ep.url else None

        await self.wait_for(
            f"{state.pod} did not run the new revision and become ready",
            canary_ready,
            float(c.ready_timeout_seconds),
            state.revision,
        )
        canary_url = engine_pod(await canary_ready() or {}, spec.engine.port)
        if canary_url is None or canary_url.url is None:
            raise CanaryFailure(f"{state.pod} has no address")

        async def routers() -> list[str]:
            sel = ",".join(f"{k}={v}" for k, v in selector_labels(self.name, "router").items())
            listed = await self.api.request(
                "GET", resource_path("v1", "pods", self.namespace), query=[("labelSelector", sel)]
            )
            return router_urls(list((listed or {}).get("items") or []), spec.router.port, self.name)

        router_list = await self.wait_for(
            "no router pod was ready to send the probe through", routers, float(c.ready_timeout_seconds), state.revision
        )
        stable_name = f"{self.name}-{state.role}-0"
        stable = None
        if stable_name != state.pod:
            pod = engine_pod(await self.api.get("v1", "Pod", self.namespace, stable_name) or {}, spec.engine.port)
            stable = pod.url if pod is not None and pod.ready and pod.url else None
        self.post(
            "Normal",
            "CanaryProbing",
            f"{state.pod} runs revision {state.revision} and is ready: probing it "
            f"for {c.duration_seconds} s at concurrency {c.concurrency}"
            + (
                f", after {stable_name} for the stable figures"
                if stable
                else " (no stable pod to compare with: one replica)"
            ),
        )
        tokens = await deployment_tokens(self.api, self.namespace, self.name) or {}
        # the engines and the routers hold different tokens: each call carries the one its target checks
        token, router_token = tokens.get(ADMIN_TOKEN_KEY), tokens.get(ROUTER_ADMIN_TOKEN_KEY)
        urls = {"routers": router_list, "canary": canary_url.url, "role": state.role, "router_token": router_token}
        if (plan.pod_ordinal(state.pod) or 0) > 0:  # the only replica keeps its traffic: nothing else could serve it
            await self.set_canary_flag(urls, True, c.traffic_percent)
        settings = probe_settings(c)
        router = router_list[0]
        stable_figures = None
        if stable is not None:
            stable_figures, _ = await run_probe(
                router, stable, state.role, settings, pin=stable, admin_token=token, router_token=router_token
            )
        figures, signals = await run_probe(
            router,
            canary_url.url,
            state.role,
            settings,
            pin=canary_url.url,
            admin_token=token,
            router_token=router_token,
        )
        return judge(figures, stable_figures, signals, thresholds(c)), urls

    async def set_canary_flag(self, urls: dict, canary: bool, traffic_percent: int = 0) -> None:
        """The routers' canary flag on the canary engine: out of (or back in) the normal rotation,
        taking `traffic_percent` percent of its role's live requests while it is a canary."""
        if not urls:
            return
        async with httpx.AsyncClient(timeout=5.0, headers=authorization_header(urls.get("router_token"))) as client:
            for router in urls["routers"]:
                try:
                    r = await client.post(
                        router + Paths.ADMIN_WORKERS,
                        json={
                            "url": urls["canary"],
                            "role": urls["role"],
                            "canary": canary,
                            "canary_percent": traffic_percent if canary else 0,
                        },
                    )
                    if r.status_code >= 400:
                        self.logger.warning(f"router {router} refused the canary flag: {r.status_code} {r.text[:200]}")
                except httpx.HTTPError as e:
                    self.logger.warning(f"router {router} did not take the canary flag: {e}")

    async def evidence(self, state: plan.CanaryState, verdict: CanaryVerdict, figures: dict) -> Optional[str]:
        name = f"{self.name}-canary-{state.revision[:10]}"
        meta = self.body["metadata"]
        cm = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": {EVIDENCE_LABEL: "true", DEPLOYMENT_LABEL: self.name},
                "ownerReferences": [
                    {"apiVersion": S.API_VERSION, "kind": S.KIND, "name": self.name, "uid": meta.get("uid", "")}
                ],
            },
            "data": {
                "verdict.json": json.dumps(verdict.to_dict(), indent=1, sort_keys=True),
                "canary.json": json.dumps(state.to_dict(), indent=1, sort_keys=True),
                "figures.json": json.dumps(figures, indent=1, sort_keys=True),
            },
        }
        try:
            await self.api.request(
                "PATCH",
                resource_path("v1", "configmaps", self.namespace, name),
                body=cm,
                content_type="application/apply-patch+yaml",
                query=[("fieldManager", self.api.field_manager), ("force", "true")],
            )
            return name
        except ApiError as e:
            self.logger.warning(f"Could not write the canary evidence ConfigMap {name}: {e}")
            return None


class _Superseded(Exception):
    """The spec changed while the canary was prepared: this canary is moot."""


def _brief(v: CanaryVerdict) -> str:
    c, s = v.canary or {}, v.stable or {}

    def ms(x: Any) -> str:
        return "-" if x is None else f"{x * 1000:.0f} ms"

    out = (
        f"{c.get('requests', 0)} requests, context up to {c.get('max_context', 0)}, TTFT p99 {ms(c.get('ttft_p99_s'))}"
    )
    if s:
        out += f" (stable {ms(s.get('ttft_p99_s'))})"
    return out


@kopf.daemon(*CR, id="canary_rollout", registry=registry, cancellation_backoff=1.0, cancellation_timeout=10.0)
async def canary_rollout(
    stopped: kopf.DaemonStopped, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    """The canary step of this deployment's engine rollouts, for as long as it exists."""

    def post(type_: str, reason: str, message: str) -> None:
        kopf.event(body, type=type_, reason=reason, message=message)

    run: Optional[CanaryRun] = None
    while not stopped:
        try:
            if run is None:
                run = CanaryRun(body, _api(memo), post, logger, _metrics(memo))
            run.api = _api(memo)
            await run.tick()
        except (ApiError, kopf.TemporaryError, httpx.HTTPError) as e:
            logger.warning(f"Canary step: {e}")
        except Exception as e:  # noqa: BLE001  a bug, an odd answer, a client closed at shutdown: said, tried again
            if stopped:
                break
            logger.exception(f"Canary step failed: {e!r}")
        await stopped.wait(TICK_SECONDS)
