"""One watchdog round, shared by the Kubernetes operator and `dsv4 up`:
scrape every engine -> detector verdicts -> policy actions -> the executor acts, step by step.

The executor is where the two worlds differ (delete a pod vs restart a process); this module
only sequences it and records each step in the policy state, so a crash mid-remediation
resumes from the first step not yet done.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Optional, Protocol

from dsv4_operator.watchdog.corroboration import Fleet, Silence, observe_silence
from dsv4_operator.watchdog.detector import Detector, Verdict, verdict_to_dict
from dsv4_operator.watchdog.groups import fold_verdicts
from dsv4_operator.watchdog.policy import (
    ABORT,
    CAPTURE_EVIDENCE,
    DRAIN,
    HELD,
    REPORT,
    RESTART,
    Action,
    PodInfo,
    PolicyState,
    RemediationSettings,
    complete_step,
    decide,
)
from dsv4_operator.remediation.scrape import scrape_all
from dsv4_operator.watchdog.signals import ScrapeTarget
from dsv4_operator.watchdog.signals import EngineSample

log = logging.getLogger("dsv4.watchdog")


class Executor(Protocol):
    """Carries out one action; returns (ok, note). Reports and holds are informational."""

    async def run(self, action: Action, verdict: Optional[Verdict]) -> tuple[bool, Optional[str]]: ...


@dataclass
class RoundResult:
    verdicts: dict[str, Verdict]
    actions: list[Action]
    results: list[tuple[Action, bool, Optional[str]]] = field(default_factory=list)
    samples: dict[str, EngineSample] = field(default_factory=dict)
    scrape_seconds: float = 0.0  # wall time of the concurrent scrape of every engine
    silence: Silence = Silence(0, ())  # Ready pods and which of them did not answer
    blind: bool = False  # the operator judged itself unable to see (silence holds are on)

    def summary(self) -> dict[str, Any]:
        return {
            "verdicts": {k: verdict_to_dict(v) for k, v in self.verdicts.items()},
            "actions": [dict(a.to_dict(), ok=ok, note=note) for a, ok, note in self.results],
        }


StateSink = Callable[[PolicyState], Awaitable[None]]


class WatchdogLoop:
    """``on_state``, when given, is awaited with the policy state after each decision and after
    each recorded step, before the next step runs: the operator persists it there, so a restart
    mid-remediation resumes after the last step done instead of repeating it.

    ``fleet`` (shared by every deployment one operator watches, under ``name``) widens the
    blindness judgement to the whole operator and holds the operator-wide restart rate limit;
    without it (``dsv4 up``) the round judges blindness from its own pods only."""

    def __init__(
        self,
        settings: RemediationSettings,
        detector: Detector,
        executor: Executor,
        state: Optional[PolicyState] = None,
        scrape_timeout: float = 2.0,
        concurrency: int = 64,
        on_state: Optional[StateSink] = None,
        fleet: Optional[Fleet] = None,
        name: str = "",
        headers: Optional[Mapping[str, str]] = None,
    ):
        self.settings = settings
        self.detector = detector
        self.executor = executor
        self.state = state or PolicyState()
        self.scrape_timeout = scrape_timeout
        self.concurrency = concurrency
        self.on_state = on_state
        self.fleet = fleet
        self.name = name
        self.session = None
        self.headers = dict(headers or {})  # the admin token: /v1/loads is behind it

    async def round(
        self,
        targets: list[ScrapeTarget],
        pods: Mapping[str, PodInfo],
        now: Optional[float] = None,
        answered_before: Mapping[str, bool] | None = None,
        groups: Mapping[str, str] | None = None,
    ) -> RoundResult:
        """`groups`: worker pod -> its group's leader (multi-node engines): every pod is judged on
        its own window, then a group's verdicts fold into its leader's (watchdog.groups), so the
        policy and the actions see the group as one engine."""
        if self.session is None:
            from .scrape import make_session

            self.session = make_session(self.concurrency, self.headers)
        started = time.monotonic()
        samples = await scrape_all(targets, self.concurrency, self.scrape_timeout, client=self.session)
        scrape_seconds = time.monotonic() - started
        now = time.time() if now is None else now
        verdicts = {
            key: self.detector.observe(key, s, answered_before=(answered_before or {}).get(key, False))
            for key, s in samples.items()
        }
        for key in set(self.detector.pods()) - set(samples):
            self.detector.forget(key)  # a pod that is gone takes its window with it
        if groups:
            verdicts = fold_verdicts(verdicts, groups)
        infos = {k: p if isinstance(p, PodInfo) else PodInfo(role=str(p)) for k, p in pods.items()}
        silence = observe_silence(verdicts, infos)
        if self.fleet is not None:
            blind = self.fleet.silence.judge(self.name, silence, now)
            allowance: Optional[int] = self.fleet.restarts.allowance(now)
        else:
            blind, allowance = silence.blind, None
        decision = decide(verdicts, infos, self.state, now, self.settings, blind=blind, restart_allowance=allowance)
        started = len(set(decision.state.active) - set(self.state.active))
        if self.fleet is not None and started:
            self.fleet.restarts.record(now, started)  # before any await: rounds interleave
        self.state = decision.state
        if self.on_state is not None:
            await self.on_state(self.state)
        result = RoundResult(
            verdicts, decision.actions, samples=samples, scrape_seconds=scrape_seconds, silence=silence, blind=blind
        )
        for action in decision.actions:
            if self.fleet is not None and not self.fleet.may_act():
                log.warning("no longer the leader: the rest of this round is not acted on")
                break
            try:
                ok, note = await self.executor.run(action, verdicts.get(action.pod))
            except Exception as e:  # an executor bug must not stop the watchdog
                log.exception("action %s on %s failed", action.kind, action.pod)
                ok, note = False, f"{type(e).__name__}: {e}"
            result.results.append((action, ok, note))
            if action.kind in (CAPTURE_EVIDENCE, DRAIN, ABORT, RESTART):
                self.state = complete_step(self.state, action.pod, action.kind, time.time(), ok=ok, note=note)
                if self.on_state is not None:
                    await self.on_state(self.state)
            if action.kind == RESTART and not ok:
                break  # retried next round; later actions of this round may depend on it
        return result

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None


__all__ = ["WatchdogLoop", "Executor", "RoundResult", "REPORT", "HELD"]
