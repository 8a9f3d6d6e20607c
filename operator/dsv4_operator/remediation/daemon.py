"""One DSV4Deployment's wedge watchdog: the loop a kopf daemon runs while the resource exists.

Every `scrapeIntervalSeconds`: list the engine pods, run one watchdog round (scrape -> detect ->
decide -> act through KubernetesExecutor; the round is shared with `dsv4 up`), then
- persist the policy state in the resource's STATE_ANNOTATION after each decision and each step,
  so a restarted operator resumes after the last step done instead of repeating it;
- record the running spec revision and mark it stable after a quiet period; when wedges begin
  soon after a spec change, name the change in the Wedged condition, and with `rollback: auto`
  pin the stable revision (dsv4_operator.pinning: an annotation the reconciler builds the
  children from; the user's spec is never rewritten, so GitOps tools have nothing to fight), at
  most once per bad revision (the history, with what was rolled back, persists in
  REVISIONS_ANNOTATION);
- write the Wedged condition and the watchdog's status fields when they change.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional

from pydantic import ValidationError

from dsv4_wire import ANNOTATION_PINNED_REVISION, ANNOTATION_REVISIONS

from dsv4_operator import spec as S
from dsv4_operator.kube import ApiError, KubeApi, PatchAborted, resource_path
from dsv4_operator.pinning import pin_value, pinned_revision, revision_spec
from dsv4_operator.remediation.executor import DeploymentContext, EventSink, KubernetesExecutor
from dsv4_operator.remediation.router_pods import RouterPodsWatch
from dsv4_operator.watchdog.pods import (
    ROUTER_PODS,
    EnginePod,
    engine_pod,
    group_status,
    pod_selector,
    worker_pod,
    remediation_settings,
    scrape_timeout,
    stable_after_seconds,
    watch_plan,
)
from dsv4_operator.watchdog.report import (
    OPERATOR_BLIND,
    blind_message,
    iso,
    merged_status,
    round_records,
    wedged_condition,
    wedged_pod_count,
)
from dsv4_operator.status import status_changed
from dsv4_operator.telemetry import OperatorMetrics
from dsv4_operator.watchdog.corroboration import Fleet
from dsv4_operator.watchdog.detector import Detector, Wedged
from dsv4_operator.watchdog.policy import STATE_ANNOTATION, PolicyState
from dsv4_operator.watchdog.signals import SGLANG
from dsv4_operator.watchdog.revisions import (
    ROLLBACK_AUTO,
    ROLLBACK_OFF,
    ROLLBACK_SUGGEST,
    RevisionTracker,
    RollbackDecision,
    SuspectChange,
    correlate,
    decide_rollback,
    describe_change,
    serving_spec,
    spec_hash,
)
from dsv4_operator.remediation.runner import RoundResult, WatchdogLoop

REVISIONS_ANNOTATION = ANNOTATION_REVISIONS
MAX_REVISIONS = 6  # kept in an annotation: a few specs, well below the 256 KiB annotation limit
IDLE_INTERVAL = 10.0  # seconds between looks at a resource whose spec cannot be read
CORRELATE_WITHIN_S = 3600.0
STATUS_WRITE_ATTEMPTS = 5

Stopped = Any  # kopf.DaemonStopped: truthy once stopping, `await stopped.wait(t)`
PodSource = Callable[[str, str], Iterable[Mapping[str, Any]]]  # (namespace, instance) -> Pod objects


class StateConflict(Exception):
    """The stored remediation state is not the one this watchdog wrote last: someone else acts."""

    def __init__(self, stored: Optional[str]) -> None:
        super().__init__("the remediation state was changed by another writer")
        self.stored = stored


@dataclass
class Episode:
    """Wedges (or remediations) on one running revision, from their first round on."""

    revision: str
    started_at: float
    suspect: Optional[SuspectChange]


class DeploymentWatchdog:
    def __init__(
        self,
        api: Callable[[], KubeApi],
        metrics: OperatorMetrics,
        body: Mapping[str, Any],
        events: EventSink,
        logger: logging.Logger | logging.LoggerAdapter,
        *,
        clock: Callable[[], float] = time.time,
        admin_token: Optional[str] = None,
        fleet: Optional[Fleet] = None,
        pods: Optional[PodSource] = None,
    ) -> None:
        meta = body["metadata"]
        self.api, self.metrics, self.body, self.events, self.logger, self.clock = (
            api,
            metrics,
            body,
            events,
            logger,
            clock,
        )
        self.namespace, self.name = meta["namespace"], meta["name"]
        annotations = dict(meta.get("annotations") or {})
        self.persisted_state: Optional[str] = annotations.get(STATE_ANNOTATION)
        self.state = self._load_state(self.persisted_state)
        self.tracker = self._load_tracker(annotations.get(REVISIONS_ANNOTATION))
        self.persisted_tracker: tuple[Optional[str], Optional[float]] = (
            self._tracker_key(),
            self.tracker.last_wedge_at,
        )
        self.ctx = DeploymentContext(self.namespace, self.name, meta["uid"])
        self.executor = KubernetesExecutor(api, self.ctx, events, metrics, admin_token=admin_token)
        # the router pods too, from the same pod index as the engines' where there is one
        router_source = None if pods is None else (lambda: pods(self.namespace, self.name, ROUTER_PODS))
        self.routers = RouterPodsWatch(api, self.namespace, self.name, events, source=router_source)
        self.loop: Optional[WatchdogLoop] = None
        self._detector_params: Optional[tuple[float, float]] = None
        self.uids: dict[str, Optional[str]] = {}
        self.episode: Optional[Episode] = None
        self.rollback_note: Optional[tuple[str, str, str]] = None  # (revision rolled back to, change, what was done)
        self.suggested: set[str] = set()
        self.fleet = fleet
        self.pod_source = pods
        self.blind_since: Optional[float] = None  # while the operator judges itself blind

    # ---- the daemon's loop ------------------------------------------------------------------------

    async def run(self, stopped: Stopped) -> None:
        try:
            while not stopped:
                started = time.monotonic()
                interval = IDLE_INTERVAL
                try:
                    interval = await self.tick()
                except StateConflict as e:
                    # Adopt what the other writer stored; the next round decides from it.
                    self.logger.warning(f"{e}: adopting the stored state, no step taken this round")
                    self.persisted_state = e.stored
                    self.state = self._load_state(e.stored)
                    if self.loop is not None:
                        self.loop.state = self.state
                except ApiError as e:
                    self.metrics.api_errors.labels(str(e.status)).inc()
                    self.logger.warning(f"Watchdog round failed: {e}")
                except Exception:  # one bad round must not end the watchdog
                    self.logger.exception("Watchdog round failed")
                await stopped.wait(max(0.0, interval - (time.monotonic() - started)))
        finally:
            await self.close()

    async def close(self) -> None:
        if self.fleet is not None:
            self.fleet.silence.forget(self.key)
        if self.loop is not None:
            await self.loop.close()
        await self.executor.close()
        await self.routers.close()
        try:
            self.metrics.wedged_pods.remove(self.namespace, self.name)
        except KeyError:
            pass

    async def tick(self) -> float:
        """One round; returns the seconds until the next."""
        if self.fleet is not None and not self.fleet.may_act():
            return IDLE_INTERVAL  # not the leader (any more): look, act and write nothing
        generation = int(self.body["metadata"].get("generation") or 0)
        try:
            raw_spec, spec = self._running_spec(generation)
        except ValidationError:
            return IDLE_INTERVAL  # the reconciler reports it (Degraded); nothing to watch by
        rem = spec.remediation
        now = self.clock()
        self.tracker.quiet_period_s = stable_after_seconds(spec.detection_window())
        revision = self.tracker.observe(generation, raw_spec, now)

        if not rem.enabled:
            self.episode = None
            await self._persist_tracker()
            pods, workers = await self._engine_pods(spec.engine.port)
            await self._write_status(
                wedged_condition(enabled=False, pods=0, verdicts={}, active={}, dry_run=False),
                {"wedgedPods": 0, **group_status(pods, watch_plan(pods, spec.engine.kind, workers).members)},
                restarts=0,
            )
            self.metrics.wedged_pods.labels(self.namespace, self.name).set(0)
            return float(rem.scrape_interval_seconds)

        loop = self._loop_for(spec)
        pods, workers = await self._engine_pods(spec.engine.port)
        plan = watch_plan(pods, spec.engine.kind, workers)
        for pod in [*pods, *workers]:
            if self.uids.get(pod.name, pod.uid) != pod.uid:
                loop.detector.forget(pod.name)  # a new incarnation starts with a fresh window
            self.uids[pod.name] = pod.uid
        self.ctx.kind, self.ctx.pods, self.ctx.revision = spec.engine.kind, {p.name: p for p in pods}, revision.hash
        self.ctx.members = plan.members
        self.ctx.spec_diff = self._spec_diff(raw_spec)

        result = await loop.round(
            plan.targets, plan.pods, now=now, answered_before=plan.answered_before, groups=plan.groups
        )
        self._count_scrapes(result)

        wedged = [p for p, v in result.verdicts.items() if isinstance(v, Wedged)]
        if wedged or loop.state.active:
            self.tracker.note_wedge(now)
            if self.episode is None or self.episode.revision != revision.hash:
                self.episode = Episode(revision.hash, now, correlate(now, self.tracker.revisions, CORRELATE_WITHIN_S))
        else:
            self.episode, self.rollback_note = None, None
            self.tracker.tick(now)

        rollback_record, suspect_words, rollback_words = None, None, None
        if self.episode is not None and self.episode.suspect is not None:
            suspect_words = self.episode.suspect.summary()
            rollback_record, rollback_words = await self._consider_rollback(rem, raw_spec, self.episode.suspect)
        elif self.rollback_note is not None and self.rollback_note[0] == revision.hash:
            # Still wedged after rolling back: keep saying which change it was and what was done.
            _, suspect_words, rollback_words = self.rollback_note
        await self._persist_tracker()

        last, restarts = round_records(result.results, self.clock(), self.executor.evidence)
        count = wedged_pod_count(result.verdicts, loop.state.active, loop.state.held)
        condition = wedged_condition(
            enabled=True,
            pods=len(pods),
            verdicts=result.verdicts,
            active=loop.state.active,
            dry_run=rem.dry_run,
            suspect=suspect_words,
            rollback=rollback_words,
            held=loop.state.held,
            blind=self._blindness(result, now),
        )
        fields: dict[str, Any] = {"wedgedPods": count, **group_status(pods, plan.members)}
        try:  # our router only: sgl-router (engine.kind sglang) has no dsv4_router metrics to judge by
            if spec.engine.kind != SGLANG:
                fields["routers"] = await self.routers.round(
                    spec.router.port,
                    spec.detection_window(),
                    scrape_timeout(rem),
                    rem.cooldown_seconds,
                    rem.dry_run,
                    now,
                )
        except ApiError as e:  # the engines' round stands; the routers are looked at next round
            self.logger.warning(f"Router pods not watched this round: {e}")
        if rollback_record is not None or last is not None:
            fields["lastRemediation"] = rollback_record or last
        await self._write_status(condition, fields, restarts)
        self.metrics.wedged_pods.labels(self.namespace, self.name).set(count)
        return float(rem.scrape_interval_seconds)

    # ---- pieces of a round ------------------------------------------------------------------------

    def _loop_for(self, spec: S.DSV4DeploymentSpec) -> WatchdogLoop:
        rem = spec.remediation
        params = (spec.detection_window(), float(rem.transfer_failure_rate_threshold))
        settings = remediation_settings(rem)
        if self.loop is None:
            self.loop = WatchdogLoop(
                settings,
                Detector(*params),
                self.executor,
                state=self.state,
                scrape_timeout=scrape_timeout(rem),
                on_state=self._persist_state,
                fleet=self.fleet,
                name=self.key,
                headers=self.executor.headers,
            )
        else:
            self.loop.settings, self.loop.scrape_timeout = settings, scrape_timeout(rem)
            if params != self._detector_params:
                self.loop.detector = Detector(*params)  # a new window length: judge from fresh windows
        self._detector_params = params
        return self.loop

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    async def _engine_pods(self, default_port: int) -> tuple[list[EnginePod], list[EnginePod]]:
        """The engine pods (a multi-node engine's leader among them) and the workers of groups."""
        if self.pod_source is not None:  # kopf's pod index, kept current by one watch
            objs = list(self.pod_source(self.namespace, self.name))
        else:
            doc = await self.api().request(
                "GET", resource_path("v1", "pods", self.namespace), query=[("labelSelector", pod_selector(self.name))]
            )
            objs = list((doc or {}).get("items") or [])
        pods = [p for p in (engine_pod(obj, default_port) for obj in objs) if p is not None]
        workers = [p for p in (worker_pod(obj, default_port) for obj in objs) if p is not None]
        return pods, workers

    def _blindness(self, result: RoundResult, now: float) -> Optional[str]:
        """Why the operator cannot trust its view of this deployment (None: it can). Said once per
        episode as a Warning Event; the Wedged condition says it every round it lasts."""
        if not (result.blind and result.silence.silent):
            if self.blind_since is not None:
                self.events(
                    "Normal",
                    "OperatorSeesAgain",
                    "the operator reaches the engine pods again; silence-based remediation resumes",
                )
            self.blind_since = None
            return None
        words = blind_message(result.silence.silent, result.silence.ready)
        if self.blind_since is None:
            self.blind_since = now
            self.events("Warning", OPERATOR_BLIND, words)
            self.logger.warning(words)
        return words

    def _count_scrapes(self, result: RoundResult) -> None:
        self.metrics.scrape_seconds.observe(result.scrape_seconds)
        for sample in result.samples.values():
            if sample.error:
                self.metrics.scrape_errors.labels(sample.role).inc()

    def _spec_diff(self, raw_spec: Mapping[str, Any]) -> list[str] | str:
        stable = self.tracker.stable
        if stable is None:
            return "(no stable revision yet: nothing to compare with)\n"
        if stable.hash == spec_hash(raw_spec):
            return f"(running the stable revision {stable.hash}: no serving change)\n"
        changes = describe_change(stable.spec, serving_spec(raw_spec))
        return [f"since stable revision {stable.hash} (generation {stable.generation}):", *changes]

    def _running_spec(self, generation: int) -> tuple[dict[str, Any], S.DSV4DeploymentSpec]:
        """The spec the children are built from: a pinned revision while its pin applies (as the
        reconciler does, from this watchdog's own history), else the user's. A pinned revision
        is the running one: it is what is watched, and it, not the spec as written, may become
        stable."""
        user = copy.deepcopy(dict(self.body.get("spec") or {}))
        parsed = S.parse_spec(user)  # ValidationError: the reconciler reports it
        revision = pinned_revision(self.body["metadata"].get("annotations"), generation)
        pinned = revision_spec(self.tracker, revision, user) if revision else None
        if pinned is not None:
            try:
                return pinned, S.parse_spec(pinned)
            except ValidationError:
                pass  # the reconciler falls back to the user's spec too
        return user, parsed

    # ---- rollback ---------------------------------------------------------------------------------

    async def _consider_rollback(
        self, rem: S.RemediationSpec, raw_spec: Mapping[str, Any], suspect: SuspectChange
    ) -> tuple[Optional[dict[str, Any]], Optional[str]]:
        mode = rem.rollback
        if rem.dry_run and mode == ROLLBACK_AUTO:
            mode = ROLLBACK_SUGGEST  # dry run acts on nothing, the spec included
        decision = decide_rollback(mode, suspect, self.tracker.stable, raw_spec, self.tracker.rolled_back)
        if decision.action == "pin":
            return await self._roll_back(decision, suspect)
        if decision.action == "suggest" and suspect.revision not in self.suggested:
            self.suggested.add(suspect.revision)
            self.events("Warning", "RollbackSuggested", f"{suspect.summary()}; {decision.message}")
        return None, (decision.message if mode != ROLLBACK_OFF else None)

    async def _roll_back(
        self, decision: RollbackDecision, suspect: SuspectChange
    ) -> tuple[Optional[dict[str, Any]], Optional[str]]:
        """Pin the stable revision: one annotation write, with the history that marks the bad
        revision rolled back in the same patch, so a crash leaves both or neither (never a
        second rollback), and only while the spec is still the bad revision."""
        stable = self.tracker.stable
        assert stable is not None and decision.from_revision is not None
        self.tracker.mark_rolled_back(decision.from_revision)
        history = self._tracker_text()
        pinned_at: list[int] = []

        def pin(cr: dict) -> dict:
            current = cr.get("spec") or {}
            if spec_hash(current) != decision.from_revision:
                raise PatchAborted("the spec changed before the rollback: not rolled back")
            generation = int(cr["metadata"].get("generation") or 0)
            pinned_at[:] = [generation]
            return {
                "metadata": {
                    "annotations": {
                        REVISIONS_ANNOTATION: history,
                        ANNOTATION_PINNED_REVISION: pin_value(stable.hash, generation),
                    }
                }
            }

        try:
            written = await self.api().patch_with_retry(S.API_VERSION, S.KIND, self.namespace, self.name, pin)
        except PatchAborted as e:
            self.tracker.rolled_back.discard(decision.from_revision)
            return None, str(e)
        except ApiError as e:
            self.tracker.rolled_back.discard(decision.from_revision)
            self.metrics.remediations.labels("rollback", "spec", "failed").inc()
            return None, f"rollback postponed: {e}"
        if written is None:
            self.tracker.rolled_back.discard(decision.from_revision)
            return None, None
        self.persisted_tracker = (self._tracker_key(), self.tracker.last_wedge_at)
        words = (
            f"rolled back to stable revision {stable.hash} (generation {stable.generation}) by pinning it "
            f"({ANNOTATION_PINNED_REVISION}={pin_value(stable.hash, pinned_at[0])}); the spec is unchanged "
            "and its next edit ends the pin"
        )
        self.rollback_note = (stable.hash, suspect.summary(), words)
        self.metrics.remediations.labels("rollback", "spec", "ok").inc()
        self.events("Warning", "RolledBack", f"{suspect.summary()}; {words}")
        self.logger.warning(f"{suspect.summary()}; {words}")
        record = {
            "time": iso(self.clock()),
            "action": "rollback",
            "reason": suspect.summary(),
            "dryRun": False,
            "result": "ok",
            "fromRevision": decision.from_revision,
            "toRevision": stable.hash,
            "pinned": pin_value(stable.hash, pinned_at[0]),
            "changes": list(suspect.changes_since_stable or suspect.changes),
        }
        return record, words

    # ---- persistence ------------------------------------------------------------------------------

    def _load_state(self, text: Optional[str]) -> PolicyState:
        try:
            return PolicyState.from_json(text)
        except (ValueError, TypeError, KeyError) as e:
            self.logger.warning(f"Ignoring an unreadable {STATE_ANNOTATION}: {e}")
            return PolicyState()

    def _load_tracker(self, text: Optional[str]) -> RevisionTracker:
        try:
            return RevisionTracker.from_dict(json.loads(text) if text else None, max_revisions=MAX_REVISIONS)
        except (ValueError, TypeError, KeyError) as e:
            self.logger.warning(f"Ignoring an unreadable {REVISIONS_ANNOTATION}: {e}")
            return RevisionTracker(max_revisions=MAX_REVISIONS)

    def _tracker_key(self) -> str:
        doc = self.tracker.to_dict()
        doc.pop("last_wedge_at", None)
        return json.dumps(doc, sort_keys=True, default=str)

    async def _persist_state(self, state: PolicyState) -> None:
        """The WatchdogLoop's sink: called after each decision and each step. Written with the
        resourceVersion read, and only over the state this watchdog wrote last: when another
        writer (a deposed leader, a second operator) changed it, raise StateConflict, which ends
        the round before any further step."""
        text = state.to_json()
        if text == self.persisted_state:
            return

        def state_patch(cr: dict) -> dict:
            stored = (cr["metadata"].get("annotations") or {}).get(STATE_ANNOTATION)
            if stored != self.persisted_state and stored != text:
                raise StateConflict(stored)
            return {"metadata": {"annotations": {STATE_ANNOTATION: text}}}

        try:
            await self.api().patch_with_retry(S.API_VERSION, S.KIND, self.namespace, self.name, state_patch)
        except ApiError as e:  # healing goes on; only a restart in this window could repeat a step
            self.metrics.api_errors.labels(str(e.status)).inc()
            self.logger.warning(f"Could not persist the remediation state: {e}")
            return
        self.persisted_state = text

    async def _persist_tracker(self, force: bool = False) -> None:
        key, wedge_at = self._tracker_key(), self.tracker.last_wedge_at
        old_key, old_wedge_at = self.persisted_tracker
        # The last wedge time moves every round of a wedge; storing it once per quiet-period
        # fifth is enough to keep a restarted operator from calling a bad revision stable.
        wedge_moved = wedge_at is not None and (
            old_wedge_at is None or wedge_at - old_wedge_at >= self.tracker.quiet_period_s / 5
        )
        if not force and key == old_key and not wedge_moved:
            return
        await self._patch_annotations({REVISIONS_ANNOTATION: self._tracker_text()})
        self.persisted_tracker = (key, wedge_at)

    def _tracker_text(self) -> str:
        return json.dumps(self.tracker.to_dict(), sort_keys=True, separators=(",", ":"), default=str)

    async def _patch_annotations(self, annotations: Mapping[str, str]) -> None:
        await self.api().patch_with_retry(
            S.API_VERSION,
            S.KIND,
            self.namespace,
            self.name,
            lambda cr: {"metadata": {"annotations": dict(annotations)}},
        )

    # ---- status -----------------------------------------------------------------------------------

    async def _write_status(self, condition: Mapping[str, Any], fields: dict[str, Any], restarts: int) -> None:
        if self.tracker.stable is not None:
            fields["stableRevision"] = self.tracker.stable.hash
        live = dict(self.body.get("status") or {})
        if (
            not restarts
            and not status_changed(live, merged_status(live, condition, fields, ""))
            and "remediationsTotal" in live
        ):
            return  # nothing new (lastTransitionTime is kept when the status does not flip)
        wrote = []

        def status_patch(cr: dict) -> Optional[dict]:
            wrote.clear()
            if cr["metadata"].get("deletionTimestamp"):
                return None
            previous = cr.get("status") or {}
            full = dict(fields, remediationsTotal=int(previous.get("remediationsTotal") or 0) + restarts)
            new = merged_status(previous, condition, full, iso(self.clock()))
            if not status_changed(previous, new):
                return None
            wrote.append(True)
            return {"status": new}

        try:
            written = await self.api().patch_with_retry(
                S.API_VERSION,
                S.KIND,
                self.namespace,
                self.name,
                status_patch,
                subresource="status",
                attempts=STATUS_WRITE_ATTEMPTS,
            )
        except ApiError as e:
            if e.status == 409:
                self.logger.warning("The status kept changing under the watchdog; will write next round")
                return
            raise
        if written is not None and wrote:
            self.metrics.status_writes.inc()
