"""What stands between the planner and issue 48's cost goal (>= 20% fewer replica-minutes than
the best static split at >= 99% of minutes within SLA): the planner on the traces of
planner_seeds (the fixed one and seven with random bursts), unchanged, then with parts of its
problem taken away one at a time.

    python -m bench.suites.planner_bound      # -> bench/results/planner/planner_bound.{json,png}

- measured: the planner as the operator runs it; it estimates the load without bursts (its
  burst reserve is burstFactor x that load) from the demand the engines report;
- exact: the planner handed each role's load without bursts from the trace itself (the request
  rate without its bursts x the mean prompt / generated tokens of a request at that point of the
  mix): what a perfect burst filter would give it;
- then also a shorter scale-down cool-down, and replicas that serve the moment they are asked for
  (no 2-5 minute start-up, none of it paid for).
The static splits compared are planner_seeds' (its JSON, committed): each trace's best split and
the one split that serves every trace.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from bench import RESULTS
from bench.harness.fleet_sim import TraceSpec, calibrate, diurnal, make_trace, tool_share
from bench.suites.planner_sim import Planner, planner_settings, simulate, summary, trace_spec

START = {"prefill": 2, "decode": 2}
STARTUP = (120.0, 300.0)
# (name, burstFactor, exact burst-free load, scale-down cool-down s, start-up range s)
VARIANTS = (
    ("measured, burstFactor 3.5", 3.5, False, 300.0, STARTUP),
    ("measured, burstFactor 3", 3.0, False, 300.0, STARTUP),
    ("exact, burstFactor 3.5", 3.5, True, 300.0, STARTUP),
    ("exact, burstFactor 3", 3.0, True, 300.0, STARTUP),
    ("exact, burstFactor 2.5", 2.5, True, 300.0, STARTUP),
    ("exact, burstFactor 3, cool-down 120 s", 3.0, True, 120.0, STARTUP),
    ("exact, burstFactor 3, no start-up", 3.0, True, 300.0, (0.0, 0.0)),
    ("exact, burstFactor 3, no start-up, cool-down 60 s", 3.0, True, 60.0, (0.0, 0.0)),
)


def exact_burst_free(spec: TraceSpec) -> Callable[[float], dict[str, float]]:
    """Each role's load without bursts at a time, from the trace's own definition: prompt tokens
    per second for prefill, generated tokens per second for decode (a request's first token
    comes from prefill)."""

    def at(t: float) -> dict[str, float]:
        tool = tool_share(t, spec)
        rate = spec.trough_rps * diurnal(t, spec)
        prompt = tool * spec.tool_prompt + (1 - tool) * spec.reason_prompt
        output = tool * spec.tool_output + (1 - tool) * spec.reason_output
        return {"prefill": rate * prompt, "decode": rate * max(0.0, output - 1)}

    return at


def static_reference(path: Path) -> dict[str, Any]:
    """planner_seeds' static splits: per trace and for every trace (None where not run)."""
    if not path.exists():
        return {"per_trace": {}, "every_trace": None}
    seeds = json.loads(path.read_text())
    return {
        "per_trace": {r["trace"]: r["best_static"]["replica_minutes"]["total"] for r in seeds["traces"]},
        "every_trace": (seeds.get("best_static_of_every_trace") or {}).get("replica_minutes"),
        "source": str(path.relative_to(RESULTS.parent)),
    }


def plot(rows: list[dict], ref: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 6))
    y = np.arange(len(rows))
    h = 0.38
    fixed = [r["traces"]["fixed"]["replica_minutes"]["total"] for r in rows]
    mean = [r["mean_replica_minutes"] for r in rows]
    ax.barh(y - h / 2, fixed, h, label="fixed trace", color="tab:green")
    ax.barh(y + h / 2, mean, h, label="mean of the 8 traces", color="tab:olive")
    for i, r in enumerate(rows):
        ax.text(
            max(fixed[i], mean[i]) + 5,
            y[i],
            f"worst trace {r['worst_sla_attainment']:.1%} of minutes; {r['traces_meeting_99pct']}/8 traces >= 99%",
            va="center",
            fontsize=8,
        )
    if ref["per_trace"].get("fixed"):
        ax.axvline(0.8 * ref["per_trace"]["fixed"], color="tab:green", ls="--", lw=1, label="goal, fixed trace")
    if ref.get("every_trace"):
        ax.axvline(0.8 * ref["every_trace"], color="tab:olive", ls=":", lw=1, label="goal, split for every trace")
    ax.set_yticks(y, [r["variant"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("replica-minutes")
    ax.set_xlim(0, max(fixed + mean) * 1.6)
    ax.set_title("The planner with parts of its problem taken away (goal: 20% below the best static split)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS / "planner")
    ap.add_argument("--seeds", type=int, nargs="*", default=[1, 2, 3, 4, 5, 6, 7])
    ap.add_argument("--ttft", type=float, default=3.0)
    ap.add_argument("--itl", type=float, default=0.06)
    args = ap.parse_args(argv)
    started = time.time()
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    timing = calibrate()
    traces = {}
    for name in ["fixed"] + [str(s) for s in args.seeds]:
        spec = trace_spec(60.0, 1, None if name == "fixed" else int(name))
        traces[name] = (spec, make_trace(spec))
    ref = static_reference(args.out / "planner_seeds.json")
    rows = []
    for variant, burst_factor, exact, cooldown, startup in VARIANTS:
        settings = planner_settings(args.ttft, args.itl, 16, burst_factor)
        # no start-up: the planner is told so (its forecast looks one interval ahead)
        settings = replace(
            settings, scale_down_cooldown_s=cooldown, startup_s=settings.startup_s if max(startup) else 0.0
        )
        per: dict[str, dict] = {}
        for name, (spec, trace) in traces.items():
            planner = Planner(settings, START, exact_burst_free(spec) if exact else None)
            r = simulate(planner, trace, timing, spec, args.ttft, args.itl, startup_s=startup)
            missed = [
                {k: m[k] for k in ("minute", "share_met", "ttft_p90", "itl_p90")}
                for m in r["minutes"]
                if not m["sla_met"]
            ]
            per[name] = summary(r) | {"missed_minutes": missed}
        total = [r["replica_minutes"]["total"] for r in per.values()]
        row = {
            "variant": variant,
            "burst_factor": burst_factor,
            "burst_free_load": "exact (from the trace)" if exact else "measured (the planner's estimate)",
            "scale_down_cooldown_s": cooldown,
            "startup_s": list(startup),
            "mean_replica_minutes": round(float(np.mean(total)), 1),
            "worst_sla_attainment": min(r["sla_attainment"] for r in per.values()),
            "traces_meeting_99pct": sum(r["sla_attainment"] >= 0.99 for r in per.values()),
            "traces": per,
        }
        if ref["per_trace"].get("fixed"):
            row["saved_vs_best_static_fixed_trace"] = round(
                1 - per["fixed"]["replica_minutes"]["total"] / ref["per_trace"]["fixed"], 3
            )
        if ref.get("every_trace"):
            row["saved_vs_static_for_every_trace_mean"] = round(1 - row["mean_replica_minutes"] / ref["every_trace"], 3)
        rows.append(row)
        log(
            f"{variant}: fixed {per['fixed']['replica_minutes']['total']:.0f}, mean {row['mean_replica_minutes']:.0f}, "
            f"worst {row['worst_sla_attainment']:.1%}, {row['traces_meeting_99pct']}/{len(per)} traces >= 99%"
        )
    report = {
        "benchmark": "planner_bound",
        "what": __doc__.split("\n\n")[0],
        "sla": {"ttft_s": args.ttft, "itl_s": args.itl},
        "static_reference": ref,
        "bursts": {name: spec.bursts for name, (spec, _) in traces.items()},
        "variants": rows,
        "wall_s": round(time.time() - started, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "planner_bound.json").write_text(json.dumps(report, indent=1, default=float))
    plot(rows, ref, args.out / "planner_bound.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
