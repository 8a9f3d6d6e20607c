"""The planner of `scaling: planner`: prefill and decode replica counts set against TTFT/ITL targets.

- `model`: the performance model of an engine (step time as a function of batch and context),
  fitted online from what the engines report, and the capacity of one replica at the targets;
- `forecast`: the next interval's load from the recent ones;
- `observe`: two scrapes of an engine -> its load over the interval between them;
- `settings`: `spec.planner` (part of the CRD's schema);
- `decision`: one round of the planner, a pure function of the loads, the settings and its state;
- `shell`: the kopf daemon that scrapes, calls `decision.decide` and carries out what it says.

Everything but `shell` is pure and imported by the simulator in bench/suites/planner_sim.py as well.
"""
