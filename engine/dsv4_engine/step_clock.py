"""Is the engine loop hung, or busy with one long step? `/ready` asks this.

A loop that has not come round for 10 s used to count as stalled. A DeepSeek-V4 flash-shape
prefill chunk takes minutes on a CPU, so a healthy engine went unready mid-step and the router
stopped sending it work. What counts as too long now follows from the step's size and the
engine's own measured speed: a step may take SLOW_FACTOR times what its tokens should take at the
rate the engine has shown, and never less than FLOOR_S.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

FLOOR_S = 10.0
SLOW_FACTOR = 5.0
# Before any step has finished, the engine has no measure of its own speed: the first step may
# take this long (a first flash-shape prefill chunk on 2 CPU cores takes a few minutes).
FIRST_STEP_S = 600.0


def step_allowance(tokens: int, tokens_per_s: Optional[float]) -> float:
    """Seconds a step of `tokens` may run before the loop counts as hung."""
    if not tokens_per_s:
        return FIRST_STEP_S
    return max(FLOOR_S, SLOW_FACTOR * tokens / tokens_per_s)


@dataclass
class StepClock:
    """The step in progress (its start and size) and the engine's slowest measured pace.

    The pace is the lowest tokens-per-second of the recent steps: a decode step of one token is
    slower per token than a prefill chunk, and an allowance too generous is harmless where one too
    tight turns a working engine unready."""

    window: int = 32
    started: Optional[float] = None
    tokens: int = 0
    _rates: list[float] = field(default_factory=list)

    def begin(self, tokens: int, now: Optional[float] = None) -> None:
        self.started, self.tokens = (time.monotonic() if now is None else now), tokens

    def end(self, now: Optional[float] = None) -> None:
        if self.started is None:
            return
        took = (time.monotonic() if now is None else now) - self.started
        if self.tokens > 0 and took > 0:
            self._rates = [*self._rates[-(self.window - 1) :], self.tokens / took]
        self.started = None

    @property
    def tokens_per_s(self) -> Optional[float]:
        return min(self._rates) if self._rates else None

    def allowance(self) -> float:
        """Seconds the loop may go without coming round: the step in progress's allowance, or
        FLOOR_S between steps (waiting for work comes round every 20 ms)."""
        if self.started is None:
            return FLOOR_S
        return step_allowance(self.tokens, self.tokens_per_s)
