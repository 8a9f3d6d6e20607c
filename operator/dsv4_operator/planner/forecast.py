"""Pure: the next intervals' load of a role from the recent ones.

Holt's linear exponential smoothing with a damped trend: a level and a trend, each smoothed,
and a forecast h intervals ahead of level + trend x (phi + phi^2 + ... + phi^h). The damping
keeps a burst's steep rise from being extrapolated for the whole start-up time of a replica.
The planner scales up for the larger of the forecast and the load measured now (a load that is
there needs serving whatever the trend says), and down only for what every forecast of the
cool-down window allows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

ALPHA = 0.5  # weight of the newest observation in the level
BETA = 0.3  # weight of the newest change in the trend
PHI = 0.85  # damping of the trend per interval ahead


@dataclass(frozen=True)
class Holt:
    level: Optional[float] = None
    trend: float = 0.0
    last: Optional[float] = None

    def observe(self, value: float) -> "Holt":
        value = max(0.0, float(value))
        if self.level is None:
            return Holt(value, 0.0, value)
        level = ALPHA * value + (1 - ALPHA) * (self.level + PHI * self.trend)
        trend = BETA * (level - self.level) + (1 - BETA) * PHI * self.trend
        return Holt(level, trend, value)

    def forecast(self, intervals: float) -> float:
        """The load `intervals` ahead (fractions allowed); 0 before any observation."""
        if self.level is None:
            return 0.0
        h = max(0.0, float(intervals))
        whole = int(h)
        damped = sum(PHI**i for i in range(1, whole + 1)) + (h - whole) * PHI ** (whole + 1)
        return max(0.0, self.level + self.trend * damped)

    def to_dict(self) -> dict[str, Any]:
        return {"level": self.level, "trend": self.trend, "last": self.last}
