"""Where the engine's steps spend their wall time, phase by phase (off by default).

The loop and the model mark the end of each phase with `PHASES.lap(name)`: the time since the
previous mark is added to that phase. Off, a lap is one attribute test (tens of ns; a step makes
about 30). On, a step's laps are summed per kind of step (decode-only or mixed/prefill), so the
decode step's breakdown is not blurred by prefills.

Phases: inbox (commands from other threads), schedule, batch_build (python -> tensors),
embed, norms (RMSNorm / mHC mixing), attention, moe (routed + shared experts, gate; V3's dense
layers count as moe too), lm_head (final norm + head), sampling, output (stop checks,
detokenising, handing tokens to sinks), after_step (gauges, the step's message to the HTTP
process). On CUDA the laps synchronise the device, so they time the kernels, not their launch
(and slow the step a little). `enable(cpu_clock=True)` times the loop thread's CPU instead of the
wall (on the CPU with 1 torch thread, the code's own cost: on a loaded machine wall laps also
hold the waits for a core, and land on whichever phase was running).

One process runs one engine loop, so the timer is a module global: the model code reaches it
without being handed it.
"""

from __future__ import annotations

import time
from typing import Optional

import torch


class StepPhases:
    def __init__(self) -> None:
        self.on = False
        self._sync = False
        self._t = 0.0
        self._clock = time.perf_counter
        self._cur: dict[str, float] = {}
        self.totals: dict[str, dict[str, float]] = {}  # kind -> phase -> seconds
        self.steps: dict[str, int] = {}
        self.decode = True  # the current step ran decode-only forwards (the runner clears it)

    def enable(self, on: bool = True, device: Optional[torch.device] = None, cpu_clock: bool = False) -> None:
        self.on = on
        self._clock = time.thread_time if cpu_clock else time.perf_counter
        self._sync = bool(on and device is not None and device.type == "cuda")
        self.reset()

    def reset(self) -> None:
        self.totals, self.steps, self._cur = {}, {}, {}

    def begin(self) -> None:
        if self.on:
            self._cur = {}
            self.decode = True
            self._t = self._clock()

    def lap(self, name: str) -> None:
        if self.on:
            if self._sync:
                torch.cuda.synchronize()
            now = self._clock()
            self._cur[name] = self._cur.get(name, 0.0) + (now - self._t)
            self._t = now

    def end(self, ran_batch: bool) -> None:
        """Close the step; a step with no batch (idle wait) is not counted."""
        if not self.on or not ran_batch:
            return
        kind = "decode" if self.decode else "mixed"
        tot = self.totals.setdefault(kind, {})
        for k, v in self._cur.items():
            tot[k] = tot.get(k, 0.0) + v
        self.steps[kind] = self.steps.get(kind, 0) + 1

    def summary(self) -> dict:
        """Per kind of step: steps, ms per step in all, and each phase's ms per step and share."""
        out: dict = {"enabled": self.on}
        for kind, tot in self.totals.items():
            n = self.steps.get(kind, 0) or 1
            step = sum(tot.values()) or 1e-12
            out[kind] = {
                "steps": self.steps.get(kind, 0),
                "ms_per_step": round(step * 1000 / n, 3),
                "phases": {
                    k: {"ms_per_step": round(v * 1000 / n, 3), "share": round(v / step, 3)}
                    for k, v in sorted(tot.items(), key=lambda kv: -kv[1])
                },
            }
        return out


PHASES = StepPhases()
