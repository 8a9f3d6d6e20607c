"""The one remediation action table both executors dispatch through."""

from __future__ import annotations

import asyncio

import pytest

from dsv4_wire import Paths
from dsv4_operator.local.up import LocalExecutor
from dsv4_operator.remediation.actions import ACTIONS, dispatch, step_for
from dsv4_operator.remediation.executor import KubernetesExecutor
from dsv4_operator.watchdog.policy import ABORT, CAPTURE_EVIDENCE, DRAIN, HELD, REPORT, RESTART, STEPS, Action
from dsv4_operator.watchdog.signals import BUILTIN, SGLANG


def test_every_policy_action_has_a_step_for_every_engine_kind() -> None:
    for engine in (BUILTIN, SGLANG):
        assert set(ACTIONS[engine]) == {*STEPS, REPORT, HELD}
    assert {k: s.event for k, s in ACTIONS[BUILTIN].items()} == {
        REPORT: "WedgeDetected",
        HELD: "RemediationHeld",
        CAPTURE_EVIDENCE: "EvidenceCaptured",
        DRAIN: "Drained",
        ABORT: "Aborted",
        RESTART: "Restarted",
    }
    assert step_for(REPORT).warning and step_for(HELD).warning and not step_for(DRAIN).warning


def test_builtin_engine_steps() -> None:
    capture = step_for(CAPTURE_EVIDENCE, BUILTIN)
    assert dict(capture.fetch) == {"stacks": Paths.DEBUG_STACKS, "loads": Paths.LOADS, "metrics": Paths.METRICS}
    drain = step_for(DRAIN, BUILTIN)
    assert drain.leaves_router and [(c.method, c.path, c.body) for c in drain.calls] == [
        ("POST", Paths.ADMIN_DRAIN, None)
    ]
    (abort,) = step_for(ABORT, BUILTIN).calls
    assert (abort.method, abort.path, dict(abort.body)) == (
        "POST",
        Paths.ADMIN_ABORT,
        {"all": True, "reason": "wedge remediation"},
    )
    assert step_for(RESTART, BUILTIN).replaces_engine and not step_for(RESTART, BUILTIN).calls


def test_sglang_steps_use_what_sglang_has() -> None:
    capture = dict(step_for(CAPTURE_EVIDENCE, SGLANG).fetch)
    assert capture["stacks"] is None  # no stack endpoint: recorded as not captured, not fetched
    assert capture["loads"] == Paths.LOADS + "?include=disagg"
    drain = step_for(DRAIN, SGLANG)
    assert drain.leaves_router and drain.calls == ()  # leaving the router is the whole drain
    (abort,) = step_for(ABORT, SGLANG).calls
    assert (abort.path, dict(abort.body)) == ("/abort_request", {"rid": "", "abort_all": True})


def test_an_unknown_engine_kind_is_taken_as_builtin_and_an_unknown_action_is_none() -> None:
    assert step_for(ABORT, "vllm-someday") == step_for(ABORT, BUILTIN)
    assert step_for("reboot_the_datacentre") is None


def test_the_table_cannot_be_changed_at_run_time() -> None:
    with pytest.raises(TypeError):
        ACTIONS[BUILTIN][DRAIN] = step_for(ABORT)  # type: ignore[index]
    with pytest.raises(TypeError):
        step_for(ABORT).calls[0].body["all"] = False  # type: ignore[index]


def test_both_executors_implement_every_step() -> None:
    for cls in (LocalExecutor, KubernetesExecutor):
        for name in ("report", "held", "capture", "drain", "abort", "restart"):
            assert asyncio.iscoroutinefunction(getattr(cls, name)), (cls, name)


def test_dispatch_refuses_an_action_it_does_not_know() -> None:
    class Nothing:
        engine_kind = BUILTIN

    action = Action(kind="reboot_the_datacentre", pod="p", role="prefill", reason="x")
    assert asyncio.run(dispatch(Nothing(), action, None)) == (False, "unknown action reboot_the_datacentre")  # type: ignore[arg-type]
