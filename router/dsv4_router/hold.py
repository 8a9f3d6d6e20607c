"""Holding new requests through a planned change (issue 45).

A roll, a reconfigure, a canary or a remediation restarts engines on purpose; while the only
engine of a role is down, a new request finds no healthy prefill/decode pair. It is held
rather than answered 503: always up to --engine-wait-timeout (a restart nobody announced), and
while a planned hold lasts -- a lease its driver (`dsv4 up`'s rollout, the operator) sets and
renews through POST /admin/hold -- up to the request's own bound (--request-timeout). The lease
lapses by itself, so a driver that dies never leaves requests held forever.

An engine that is shutting down answers 503 `shutting_down`: that says nothing about the
request, so `draining_refusal` lets the router take the engine out of rotation at once and send
the request elsewhere without counting it against --migration-limit. Pure, except `PlannedHold`'s
clock, which its caller passes in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from dsv4_wire.errors import SHUTTING_DOWN

MAX_HOLD_S = 3600.0  # one lease at most; a longer change renews it


def draining_refusal(status: int, content: bytes) -> bool:
    """The engine refused the request because it is shutting down (it never ran it)."""
    if status != 503 or not content:
        return False
    try:
        err = json.loads(content).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(err, dict) and err.get("code") == SHUTTING_DOWN


def may_keep_waiting(waited_s: float, engine_wait_s: float, hold_left_s: float, request_bound_s: float) -> bool:
    """Whether a new request that has waited `waited_s` for a healthy pair waits on: within
    --engine-wait-timeout always; past it while a planned hold lasts, up to its own bound."""
    if waited_s < engine_wait_s:
        return True
    return hold_left_s > 0 and waited_s < request_bound_s


@dataclass
class PlannedHold:
    """The current lease: until when (monotonic), why, and who set it."""

    until: float = 0.0
    reason: str = ""

    def set(self, seconds: float, reason: str, now: float) -> None:
        self.until = now + min(max(seconds, 0.0), MAX_HOLD_S)
        self.reason = reason

    def clear(self) -> None:
        self.until, self.reason = 0.0, ""

    def left(self, now: float) -> float:
        return max(0.0, self.until - now)

    def view(self, now: float) -> dict:
        left = self.left(now)
        return {"holding": left > 0, "seconds_left": round(left, 3), "reason": self.reason if left > 0 else ""}


def parse_hold(body: dict) -> Optional[tuple[float, str]]:
    """(seconds, reason) from a POST /admin/hold body; None when it is not one."""
    seconds, reason = body.get("seconds"), body.get("reason", "")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= MAX_HOLD_S:
        return None
    if not isinstance(reason, str):
        return None
    return float(seconds), reason[:200]
