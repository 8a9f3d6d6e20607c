"""`dsv4 up`'s watch on its router (issue 45): the router can be the wedge point while every
engine idles (requests held inside it, none sent on), or be frozen (its /metrics unanswered).
The same detector as the engines' (kind ROUTER: watchdog.hangs.router_stalled, and
unresponsive), reported as a WedgeDetected event with the verdict's evidence and kept in
status.json; nothing restarts the router on it (it is the only one: report, not act)."""

from __future__ import annotations

from typing import Any, Optional

from dsv4_operator.remediation.scrape import scrape_engine
from dsv4_operator.watchdog.detector import Detector, Wedged, verdict_to_dict
from dsv4_operator.watchdog.signals import ROUTER

KEY = "router"


class RouterWatch:
    def __init__(self, window_s: float) -> None:
        self.detector = Detector(window_s=window_s)
        self.verdict: dict[str, Any] = {"state": "Healthy"}
        self._said: Optional[str] = None  # the wedge reason already reported

    async def round(self, client: Any, url: str, incarnation: str) -> Optional[dict]:
        """One scrape and verdict; the verdict's dict when it newly says Wedged, else None.
        `incarnation`: the router process's identity (a restarted router starts afresh)."""
        sample = await scrape_engine(client, url, KEY, ROUTER, timeout=2.0)
        verdict = self.detector.observe(f"{KEY}/{incarnation}", sample, answered_before=True)
        self.verdict = verdict_to_dict(verdict)
        if not isinstance(verdict, Wedged):
            self._said = None
            return None
        if self._said == verdict.reason:
            return None
        self._said = verdict.reason
        return self.verdict
