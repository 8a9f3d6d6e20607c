"""A writer that keeps changing a child (pure): a mutating webhook, another controller, a script.

Drift repair answers each foreign change with one re-apply; against a writer that changes the
child again at once, that is one API write (and one Event) per foreign write, without end. Real
controllers fight too; ours notices (REPAIRS_BEFORE_BACKOFF repairs of one child within WINDOW
seconds), waits before the next repair (doubling, capped), and says so once per fight with a
Warning Event naming the child and the other field manager. A child left alone for QUIET seconds
ends the fight: the next change is repaired at once again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable, Mapping, Optional

WINDOW_SECONDS = 60.0
REPAIRS_BEFORE_BACKOFF = 3
BACKOFF_BASE_SECONDS = 5.0
BACKOFF_CAP_SECONDS = 300.0


@dataclass(frozen=True)
class RepairDecision:
    delay: float  # seconds to wait before repairing (0: now)
    warn: bool  # the fight just started: post the one Warning


@dataclass
class _Fight:
    repairs: deque = field(default_factory=deque)  # times of recent repairs
    level: int = 0  # back-off doublings so far
    warned: bool = False
    last: float = 0.0


class FightTracker:
    def __init__(
        self,
        window: float = WINDOW_SECONDS,
        threshold: int = REPAIRS_BEFORE_BACKOFF,
        base: float = BACKOFF_BASE_SECONDS,
        cap: float = BACKOFF_CAP_SECONDS,
    ) -> None:
        self.window, self.threshold, self.base, self.cap = window, threshold, base, cap
        self._fights: dict[Hashable, _Fight] = {}

    def quiet_seconds(self) -> float:
        return 2 * self.cap

    def decide(self, key: Hashable, now: float) -> RepairDecision:
        """Pure but for the tracker's memory: how to answer a foreign change of child `key` now."""
        fight = self._fights.get(key)
        if fight is None or now - fight.last > self.quiet_seconds():
            fight = self._fights[key] = _Fight()
        while fight.repairs and now - fight.repairs[0] > self.window:
            fight.repairs.popleft()
        if len(fight.repairs) < self.threshold and not fight.level:
            return RepairDecision(0.0, False)
        delay = min(self.cap, self.base * 2**fight.level)
        warn = not fight.warned
        fight.warned = True
        return RepairDecision(delay, warn)

    def repaired(self, key: Hashable, now: float, backed_off: bool = False) -> None:
        """A repair was made (`backed_off`: after a wait, so the next wait doubles)."""
        fight = self._fights.setdefault(key, _Fight())
        fight.repairs.append(now)
        fight.last = now
        if backed_off:
            fight.level = min(fight.level + 1, 16)

    def fighting(self, key: Hashable) -> bool:
        fight = self._fights.get(key)
        return fight is not None and fight.warned


def other_manager(managed_fields: Optional[Iterable[Mapping[str, Any]]], own: Iterable[str]) -> Optional[str]:
    """Pure: the field manager other than ours that wrote the object last (managedFields)."""
    ours = set(own)
    entries = [
        m
        for m in managed_fields or []
        if m.get("manager") and m.get("manager") not in ours and m.get("subresource") != "status"
    ]
    if not entries:
        return None
    return max(entries, key=lambda m: str(m.get("time") or ""))["manager"]
