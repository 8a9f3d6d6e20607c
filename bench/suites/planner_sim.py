"""The planner in a simulated PD fleet: SLA attainment and replica-minutes against static P:D
splits and an HPA-like rule (issue 48).

    python -m bench.suites.planner_sim                      # the comparison -> bench/results/planner/
    python -m bench.suites.planner_sim --random-bursts 7    # the bursts at random minutes
    python -m bench.suites.planner_sim --minutes 10 --quick # a short look

The fleet, its calibration from dsv4's own results and the SLA are bench/harness/fleet_sim.py's.
The planner reads the simulated engines through the same code the operator uses
(dsv4_operator.planner.observe) and decides with the same pure function (decision.decide).

The trace (60 minutes, a day compressed): a diurnal rate from the trough to 4x at minute 30 and
back; three bursts of 3x the rate at that moment, of 3-4 minutes each with 30-second ramps;
the request mix moving between tool-result-heavy (long prompts, short answers) and
reasoning-heavy (short prompts, long answers) on a 40-minute cycle.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from bench import RESULTS
from bench.harness.fleet_sim import (
    MINUTE_MET_SHARE,
    NOISE,
    SLICE,
    Fleet,
    Request,
    Timing,
    TraceSpec,
    calibrate,
    make_trace,
    minute_attainment,
    rate,
    tool_share,
)
from dsv4_operator.planner.decision import (
    DRAIN,
    SCALE_DOWN,
    SCALE_UP,
    PlannerState,
    RoleObservation,
    Settings,
    decide,
)
from dsv4_operator.planner.observe import Reading, engine_load

# ---- policies ------------------------------------------------------------------------------------


class Policy:
    name = "policy"
    interval = 15.0

    def start(self, fleet: Fleet) -> None: ...

    def act(self, fleet: Fleet, now: float) -> None: ...


class Static(Policy):
    def __init__(self, prefill: int, decode: int):
        self.counts = {"prefill": prefill, "decode": decode}
        self.name = f"static {prefill}P:{decode}D"
        self.interval = 1e9

    def start(self, fleet: Fleet) -> None:
        for role, n in self.counts.items():
            for _ in range(n):
                fleet.add(role, 0.0, startup=0.0)


class HPALike(Policy):
    """Kubernetes' HPA on one metric per pod, for each role: running + queued requests (the
    engines' dsv4:num_running_reqs + dsv4:num_queue_reqs and PD queue gauges, what a KEDA
    ScaledObject would read). desired = ceil(sum over ready pods / target) when the ratio is
    outside the 10% tolerance; scale-up at most doubles (or +4) per 15 s; scale-down takes the
    highest desired count of the last 300 s (the HPA's default stabilization)."""

    def __init__(self, target: float, lo: dict, hi: dict, initial: dict):
        self.target, self.lo, self.hi, self.initial = target, lo, hi, initial
        self.name = f"HPA-like (target {target:g} requests/pod)"
        self.history: dict[str, list[tuple[float, int]]] = {"prefill": [], "decode": []}

    def start(self, fleet: Fleet) -> None:
        for role, n in self.initial.items():
            for _ in range(n):
                fleet.add(role, 0.0, startup=0.0)

    def act(self, fleet: Fleet, now: float) -> None:
        for role in ("prefill", "decode"):
            live = fleet.live(role)
            n = len([e for e in live if e.draining_since is None])
            ready = [e for e in live if e.serving(now)]
            total = sum(len(e.running) + len(e.queue) for e in ready)
            if role == "decode":
                total += sum(1 for when, _ in fleet.handoff if when <= now)
            else:
                total += len(fleet.router_queue)
            current = max(1, len(ready))
            ratio = (total / current) / self.target
            desired = n if abs(ratio - 1) <= 0.1 else math.ceil(total / self.target)
            desired = max(self.lo[role], min(self.hi[role], desired))
            if desired > n:
                desired = min(desired, max(2 * n, n + 4))
            hist = [(t, d) for t, d in self.history[role] if now - t < 300] + [(now, desired)]
            self.history[role] = hist
            if desired < n:
                desired = max(d for _, d in hist)
            if desired != n:
                fleet.set_replicas(role, desired, now)


class Planner(Policy):
    """dsv4's planner: decision.decide on what the simulated engines report."""

    name = "planner"

    def __init__(self, settings: Settings, initial: dict, burst_free: Optional[Callable[[float], dict]] = None):
        # burst_free: each role's load without bursts at a time, when the planner is handed it
        # (planner_bound.py: the bound of a perfect burst filter); None: the planner estimates it
        self.settings, self.initial, self.burst_free = settings, initial, burst_free
        self.interval = settings.interval_s
        self.state = PlannerState()
        self.before: dict[str, Reading] = {}
        self.decisions: list[dict] = []

    def start(self, fleet: Fleet) -> None:
        for role, n in self.initial.items():
            for _ in range(n):
                fleet.add(role, 0.0, startup=0.0)

    def act(self, fleet: Fleet, now: float) -> None:
        obs = {}
        for role in ("prefill", "decode"):
            live = fleet.live(role)
            loads = []
            for e in live:
                if not e.ready(now):
                    continue
                reading = e.reading(now)
                key = f"{e.name}@{e.created}"
                loads.append(
                    engine_load(e.name, role, self.before.get(key), reading, draining=e.draining_since is not None)
                )
                self.before[key] = reading
            obs[role] = RoleObservation(
                role=role,
                replicas=len(live),
                statefulset=role,
                engines=tuple(loads),
                ready=sum(1 for e in live if e.ready(now)),
            )
        decision = decide(obs, self.state, self.settings, now, self.burst_free(now) if self.burst_free else None)
        self.state = decision.state
        for role, d in decision.roles.items():
            if d.action == SCALE_UP:
                fleet.set_replicas(role, d.target, now)
            elif d.action == DRAIN:
                fleet.drain(role, list(d.drain), now)
            elif d.action == SCALE_DOWN:
                fleet.set_replicas(role, d.target, now, remove_now=True)
            if d.changes:
                self.decisions.append(
                    {"t": round(now, 1), "role": role, "action": d.action, "target": d.target, "message": d.message()}
                )


def simulate(
    policy: Policy,
    trace: list[Request],
    timing: Timing,
    spec: TraceSpec,
    ttft: float,
    itl: float,
    seed: int = 7,
    startup_s: tuple[float, float] = (120.0, 300.0),
) -> dict:
    import copy

    trace = copy.deepcopy(trace)
    fleet = Fleet(timing, ttft, itl, drain_timeout=120.0, seed=seed, startup_s=startup_s)
    policy.start(fleet)
    end = spec.minutes * 60.0
    arrivals = [r.arrival for r in trace]
    i, now, next_act = 0, 0.0, policy.interval
    tail = end + 900.0  # no arrivals after the hour: the last requests finish
    while now < tail:
        j = bisect.bisect_left(arrivals, now + SLICE, lo=i)
        for r in trace[i:j]:
            fleet.router_queue.append(r)
        i = j
        fleet.tick(now, SLICE)
        now += SLICE
        if now >= next_act and now < end:
            policy.act(fleet, now)
            next_act += policy.interval
        if int(now) % 15 == 0 and abs(now - int(now)) < 1e-9:
            fleet.count_log.append(
                (
                    now,
                    fleet.replicas("prefill"),
                    fleet.replicas("decode"),
                    sum(e.ready(now) for e in fleet.live("prefill")),
                    sum(e.ready(now) for e in fleet.live("decode")),
                )
            )
        if (
            now >= end
            and i >= len(trace)
            and not fleet.router_queue
            and not fleet.handoff
            and all(e.idle() for role in fleet.engines.values() for e in role if e.removed is None)
        ):
            break
    minutes = int(spec.minutes)
    rows = minute_attainment(trace, minutes, ttft, itl)
    rm = fleet.replica_minutes(end)
    met = sum(r["sla_met"] for r in rows)
    return {
        "policy": policy.name,
        "sla_minutes_met": met,
        "sla_attainment": met / minutes,
        "replica_minutes": {**{k: round(v, 1) for k, v in rm.items()}, "total": round(sum(rm.values()), 1)},
        "requests": len(trace),
        "requests_met": sum(
            1
            for r in trace
            if r.first_token is not None
            and r.first_token - r.arrival <= ttft
            and r.done is not None
            and r.decode_time / max(1, r.output - 1) <= itl
        ),
        "unfinished": sum(1 for r in trace if r.done is None),
        "migrated": sum(1 for r in trace if r.migrations),
        "minutes": rows,
        "counts": fleet.count_log,
        "decisions": getattr(policy, "decisions", []),
    }


# ---- the comparison ------------------------------------------------------------------------------


def best_static(
    trace, timing, spec, ttft, itl, max_p: int, max_d: int, log: Callable[[str], None]
) -> tuple[dict, list]:
    """The static split with the fewest replicas whose SLA attainment is at least 99%, found by a
    sweep (each role's count swept with the other generous, then every split around the two
    minima); the best attainment if none reaches 99%."""
    tried: dict[tuple[int, int], dict] = {}

    def run(p: int, d: int) -> dict:
        if (p, d) not in tried:
            r = simulate(Static(p, d), trace, timing, spec, ttft, itl)
            tried[(p, d)] = r
            log(
                f"  static {p}P:{d}D: {r['sla_attainment']:.1%} of minutes, {r['replica_minutes']['total']:.0f} replica-minutes"
            )
        return tried[(p, d)]

    p_min = next((p for p in range(1, max_p + 1) if run(p, max_d)["sla_attainment"] >= 0.99), max_p)
    d_min = next((d for d in range(1, max_d + 1) if run(max(p_min, 1), d)["sla_attainment"] >= 0.99), max_d)
    for p in range(max(1, p_min - 1), min(max_p, p_min + 2) + 1):
        for d in range(max(1, d_min - 1), min(max_d, d_min + 2) + 1):
            run(p, d)
    ok = [r for r in tried.values() if r["sla_attainment"] >= 0.99]
    best = (
        min(ok, key=lambda r: r["replica_minutes"]["total"])
        if ok
        else max(tried.values(), key=lambda r: r["sla_attainment"])
    )
    sweep = [
        {
            "prefill": p,
            "decode": d,
            "sla_attainment": r["sla_attainment"],
            "replica_minutes": r["replica_minutes"]["total"],
        }
        for (p, d), r in sorted(tried.items())
    ]
    return best, sweep


def summary(r: dict) -> dict:
    return {
        k: r[k]
        for k in (
            "policy",
            "sla_minutes_met",
            "sla_attainment",
            "replica_minutes",
            "requests",
            "requests_met",
            "unfinished",
            "migrated",
        )
    }


def plot(report: dict, runs: dict, spec: TraceSpec, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(11, 13), sharex=True)
    t = np.arange(0, spec.minutes * 60, 10.0)
    axes[0].plot(t / 60, [rate(x, spec) for x in t], label="requests/s")
    ax2 = axes[0].twinx()
    ax2.plot(t / 60, [tool_share(x, spec) for x in t], color="tab:gray", ls="--", label="tool-heavy share")
    ax2.set_ylabel("tool-result-heavy share")
    axes[0].set_ylabel("arrival rate (req/s)")
    axes[0].set_title("Trace: diurnal (peak 4x trough), 3x bursts, shifting prefill/decode mix")
    colors = {"planner": "tab:green", "static": "tab:blue", "hpa": "tab:red"}
    for key, r in runs.items():
        c = np.array(r["counts"])
        if len(c) == 0:
            continue
        axes[1].step(c[:, 0] / 60, c[:, 1], where="post", color=colors[key], label=f"{r['policy']}")
        axes[2].step(c[:, 0] / 60, c[:, 2], where="post", color=colors[key], label=f"{r['policy']}")
        share = [m["share_met"] for m in r["minutes"]]
        axes[3].plot(
            np.arange(len(share)) + 0.5,
            share,
            marker=".",
            color=colors[key],
            label=f"{r['policy']}: {r['sla_attainment']:.1%} of minutes, {r['replica_minutes']['total']:.0f} replica-min",
        )
    axes[1].set_ylabel("prefill replicas")
    axes[2].set_ylabel("decode replicas")
    axes[3].axhline(MINUTE_MET_SHARE, color="k", lw=0.8, ls=":")
    axes[3].set_ylabel("share of the minute's requests within SLA")
    axes[3].set_xlabel("minute")
    axes[3].set_ylim(0, 1.05)
    for ax in axes[1:]:
        ax.legend(fontsize=8, loc="upper left")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def trace_spec(minutes: float = 60.0, seed: int = 1, random_bursts: Optional[int] = None) -> TraceSpec:
    """The trace: the bursts at minutes 13, 29 and 46 (scaled to `minutes`), or, with
    `random_bursts`, three bursts of 3-4 minutes starting at minutes drawn uniformly from that seed."""
    spec = TraceSpec(minutes=minutes, seed=seed)
    if minutes < 60:
        scale = minutes / 60
        spec = TraceSpec(
            minutes=minutes,
            seed=seed,
            bursts=tuple((s * scale, l) for s, l in spec.bursts),
            mix_period_min=40 * scale,
        )
    if random_bursts is not None:
        rng = random.Random(random_bursts)
        starts = sorted(rng.uniform(2.0, minutes - 6.0) for _ in range(3))
        lengths = [rng.uniform(3.0, 4.0) for _ in range(3)]
        spec = TraceSpec(
            **{**spec.__dict__, "bursts": tuple((round(a, 1), round(b, 1)) for a, b in zip(starts, lengths))}
        )
    return spec


def planner_settings(ttft: float, itl: float, max_replicas: int, burst_factor: float) -> Settings:
    """The planner's settings in the benchmark (the operator's defaults but these)."""
    n = {"prefill": max_replicas, "decode": max_replicas}
    return Settings(
        interval_s=30.0,
        ttft_target_s=ttft,
        itl_target_s=itl,
        min_replicas={"prefill": 1, "decode": 1},
        max_replicas=n,
        drain_timeout_s=120.0,
        startup_s=180.0,
        max_unavailable={"prefill": 2, "decode": 2},
        burst_factor=burst_factor,
    )


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS / "planner")
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--ttft", type=float, default=3.0, help="TTFT target, seconds")
    ap.add_argument("--itl", type=float, default=0.06, help="ITL target, seconds")
    ap.add_argument("--max-replicas", type=int, default=16)
    ap.add_argument("--burst-factor", type=float, default=3.5, help="the planner's burstFactor (the run compared)")
    ap.add_argument("--burst-sweep", type=float, nargs="*", default=[1.0, 2.0, 3.0, 4.0], help="other burstFactors run")
    ap.add_argument("--hpa-targets", type=float, nargs="*", default=[4.0, 8.0, 12.0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="no static sweep, one HPA target")
    ap.add_argument(
        "--random-bursts",
        type=int,
        default=None,
        metavar="SEED",
        help="the three bursts at minutes drawn uniformly from this seed (default: at 13, 29 and 46, the "
        "peaks of the prefill-heavy mix, of the day and of the next prefill-heavy mix)",
    )
    args = ap.parse_args(argv)
    started = time.time()
    timing = calibrate()
    spec = trace_spec(args.minutes, args.seed, args.random_bursts)
    trace = make_trace(spec)
    log = lambda s: print(s, file=sys.stderr, flush=True)
    log(f"calibrated: decode {timing.decode}, prefill {timing.prefill}; {len(trace)} requests")
    lo, hi = {"prefill": 1, "decode": 1}, {"prefill": args.max_replicas, "decode": args.max_replicas}
    settings = planner_settings(args.ttft, args.itl, args.max_replicas, args.burst_factor)
    planner = simulate(Planner(settings, {"prefill": 2, "decode": 2}), trace, timing, spec, args.ttft, args.itl)
    log(f"planner: {planner['sla_attainment']:.1%}, {planner['replica_minutes']}")
    burst_sweep = []
    for b in [] if args.quick else args.burst_sweep:
        from dataclasses import replace as _replace

        r = simulate(
            Planner(_replace(settings, burst_factor=b), {"prefill": 2, "decode": 2}),
            trace,
            timing,
            spec,
            args.ttft,
            args.itl,
        )
        log(f"planner burstFactor {b}: {r['sla_attainment']:.1%}, {r['replica_minutes']}")
        burst_sweep.append({"burst_factor": b, **summary(r)})
    hpas = []
    for target in args.hpa_targets[: 1 if args.quick else None]:
        r = simulate(HPALike(target, lo, hi, {"prefill": 2, "decode": 2}), trace, timing, spec, args.ttft, args.itl)
        log(f"{r['policy']}: {r['sla_attainment']:.1%}, {r['replica_minutes']}")
        hpas.append(r)
    static, sweep = (None, [])
    if not args.quick:
        static, sweep = best_static(trace, timing, spec, args.ttft, args.itl, args.max_replicas, args.max_replicas, log)
    hpa = max(hpas, key=lambda r: (r["sla_attainment"], -r["replica_minutes"]["total"]))
    report: dict[str, Any] = {
        "benchmark": "planner_sim",
        "what": "dsv4's planner (dsv4_operator.planner.decision.decide) driving simulated prefill/decode engines",
        "calibration": {
            "decode_step_s": {
                "a": timing.decode[0],
                "b_per_stream": timing.decode[1],
                "c_per_stream_token": timing.decode[2],
            },
            "prefill_step_s": {
                "p0": timing.prefill[0],
                "p1_per_token": timing.prefill[1],
                "p2_per_token_context": timing.prefill[2],
            },
            "points": timing.points,
            "sources": ["bench/results/serve-native/serve.json", "bench/results/prefix.json"],
            "kv_tokens_per_decode_replica": timing.kv_tokens,
            "max_batch": timing.max_batch,
            "max_batched_tokens": timing.max_batched_tokens,
            "step_noise_sigma": NOISE,
        },
        "trace": {**spec.__dict__, "requests": len(trace)},
        "sla": {"ttft_s": args.ttft, "itl_s": args.itl, "minute_met_share": MINUTE_MET_SHARE},
        "startup_s": [120, 300],
        "planner_settings": {k: (dict(v) if isinstance(v, dict) else v) for k, v in settings.__dict__.items()},
        "planner": summary(planner),
        "best_static": summary(static) if static else None,
        "static_sweep": sweep,
        "hpa_like": [summary(r) for r in hpas],
        "planner_burst_factor_sweep": burst_sweep,
        "hpa_like_compared": hpa["policy"],
        "per_minute": {
            "planner": planner["minutes"],
            **({"best_static": static["minutes"]} if static else {}),
            "hpa_like": hpa["minutes"],
        },
        "planner_decisions": planner["decisions"],
        "wall_s": round(time.time() - started, 1),
    }
    if static:
        saved = 1 - planner["replica_minutes"]["total"] / static["replica_minutes"]["total"]
        report["goal"] = {
            "planner_sla_at_least_99pct": planner["sla_attainment"] >= 0.99,
            "replica_minutes_saved_vs_best_static": round(saved, 3),
            "at_least_20pct_fewer_than_best_static": saved >= 0.2,
            "better_sla_than_hpa_like": planner["sla_attainment"] > hpa["sla_attainment"],
            "fewer_replica_minutes_than_hpa_like": planner["replica_minutes"]["total"]
            < hpa["replica_minutes"]["total"],
        }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "planner_sim" + ("_random_bursts" if args.random_bursts is not None else "")
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=float))
    runs = {"planner": planner, "hpa": hpa, **({"static": static} if static else {})}
    plot(report, runs, spec, args.out / f"{stem}.png")
    log(
        json.dumps(
            {k: report[k] for k in ("planner", "best_static", "hpa_like_compared")} | {"goal": report.get("goal")},
            indent=1,
            default=float,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
