"""Pure: a role's load without bursts in it, the planner's baseline (its burst reserve is
`burstFactor` x the baseline), from each interval's demand.

A smoothing whose every step is clipped to BASELINE_STEP of the baseline: a steady rise (a
day's) is followed, a burst lifts it by at most that step an interval, and the noise of one
interval moves it as little up as down. Never above the smoothed level (a drop is followed at
once). What telling bursts apart better would save is bounded by the planner's benchmark, which
can hand the planner the exact burst-free load of its trace instead (docs/operations.md,
"What it costs").
"""

from __future__ import annotations

from typing import Optional

BASELINE_STEP = 0.1  # the baseline takes at most this share of itself from one interval's demand...
# ...with this weight. A whole step: the compressed day's decode load (diurnal x a mix turning
# reasoning-heavy) rises up to ~12%/minute, and a baseline that lags it leaves the reserve short
# when a burst comes (at 0.5 it lagged by half after 12 minutes: bench/results/planner). A burst
# lifts it too (up to 10% an interval); slowing that down re-opened the lag (tried: 2-5%).
BASELINE_ALPHA = 1.0


def next_baseline(previous: Optional[float], level: Optional[float], value: float) -> float:
    """The baseline after an interval whose demand was `value` (`previous`: the baseline before
    it; `level`: the demand smoothed, this interval included)."""
    level = level or value
    if not previous:
        return min(level, value) if value else level
    step = max(-BASELINE_STEP * previous, min(BASELINE_STEP * previous, value - previous))
    return max(0.0, min(level, previous + BASELINE_ALPHA * step))
