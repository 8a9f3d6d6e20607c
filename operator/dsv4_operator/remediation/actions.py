"""What each remediation action means, written once for both executors (`dsv4 up`'s processes and
the operator's pods).

The policy (`watchdog.policy`) says *which* action to take; this table says *what it is* for a
kind of engine: which Event it leaves, what evidence to fetch from which path, which admin calls
to make with which body, whether the engine leaves the router or is replaced. The executors keep
only what differs between a cluster and a laptop: how a pod leaves the router (a label vs the
router's /admin/workers), how it is replaced (delete the pod vs start a new process) and where
evidence goes (a ConfigMap vs files).

Pure data plus one dispatch; no I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Optional, Protocol

from dsv4_wire import Paths

from dsv4_operator.watchdog.detector import Verdict
from dsv4_operator.watchdog.policy import ABORT, CAPTURE_EVIDENCE, DRAIN, HELD, REPORT, RESTART, Action
from dsv4_operator.remediation.scrape import LOADS_PATH
from dsv4_operator.watchdog.signals import BUILTIN, SGLANG

ABORT_REASON = "wedge remediation"


@dataclass(frozen=True)
class AdminCall:
    """One HTTP call on the engine (sent with the admin token where one is set)."""

    method: str
    path: str
    body: Optional[Mapping[str, Any]] = None


@dataclass(frozen=True)
class Step:
    """One policy action for one kind of engine."""

    event: str  # the Event reason both executors record
    warning: bool = False  # a Warning event (the rest are Normal)
    # capture: (what, path) fetched from the engine; path None: the engine has no such endpoint
    fetch: tuple[tuple[str, Optional[str]], ...] = ()
    calls: tuple[AdminCall, ...] = ()  # admin calls on the engine, in order, best effort
    leaves_router: bool = False  # drain: the router stops sending it requests
    replaces_engine: bool = False  # restart: a new incarnation, only of the one the policy judged


def _table(engine: str) -> dict[str, Step]:
    builtin = engine == BUILTIN
    return {
        REPORT: Step("WedgeDetected", warning=True),
        HELD: Step("RemediationHeld", warning=True),
        CAPTURE_EVIDENCE: Step(
            "EvidenceCaptured",
            fetch=(
                # SGLang has no stack dump endpoint: its stacks come from py-spy, outside our reach.
                ("stacks", Paths.DEBUG_STACKS if builtin else None),
                ("loads", LOADS_PATH[engine]),
                ("metrics", Paths.METRICS),
            ),
        ),
        # SGLang has no drain endpoint: leaving the router is the whole drain.
        DRAIN: Step("Drained", calls=(AdminCall("POST", Paths.ADMIN_DRAIN),) if builtin else (), leaves_router=True),
        ABORT: Step(
            "Aborted",
            calls=(
                AdminCall("POST", Paths.ADMIN_ABORT, MappingProxyType({"all": True, "reason": ABORT_REASON}))
                if builtin
                else AdminCall("POST", "/abort_request", MappingProxyType({"rid": "", "abort_all": True})),
            ),
        ),
        RESTART: Step("Restarted", replaces_engine=True),
    }


ACTIONS: Mapping[str, Mapping[str, Step]] = MappingProxyType(
    {engine: MappingProxyType(_table(engine)) for engine in (BUILTIN, SGLANG)}
)


def step_for(action_kind: str, engine_kind: str = BUILTIN) -> Optional[Step]:
    """The step of ``action_kind`` for ``engine_kind`` (an unknown engine kind is taken as the
    builtin engine); None for an action the table does not know."""
    return ACTIONS.get(engine_kind, ACTIONS[BUILTIN]).get(action_kind)


class Steps(Protocol):
    """What an executor implements: one coroutine per action, each returning (ok, note); each
    reads its `Step` with ``step_for(action.kind, self.engine_kind)``."""

    engine_kind: str

    async def report(self, action: Action, verdict: Optional[Verdict]) -> tuple[bool, Optional[str]]: ...
    async def held(self, action: Action, verdict: Optional[Verdict]) -> tuple[bool, Optional[str]]: ...
    async def capture(self, action: Action, verdict: Optional[Verdict]) -> tuple[bool, Optional[str]]: ...
    async def drain(self, action: Action, verdict: Optional[Verdict]) -> tuple[bool, Optional[str]]: ...
    async def abort(self, action: Action, verdict: Optional[Verdict]) -> tuple[bool, Optional[str]]: ...
    async def restart(self, action: Action, verdict: Optional[Verdict]) -> tuple[bool, Optional[str]]: ...


async def dispatch(executor: Steps, action: Action, verdict: Optional[Verdict]) -> tuple[bool, Optional[str]]:
    """Run ``action`` on ``executor``: the one place an action kind becomes a step."""
    if step_for(action.kind, executor.engine_kind) is None:
        return False, f"unknown action {action.kind}"
    run = {
        REPORT: executor.report,
        HELD: executor.held,
        CAPTURE_EVIDENCE: executor.capture,
        DRAIN: executor.drain,
        ABORT: executor.abort,
        RESTART: executor.restart,
    }[action.kind]
    return await run(action, verdict)
