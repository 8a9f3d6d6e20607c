"""The planner in a simulated PD fleet: SLA attainment and replica-minutes against static P:D
splits and an HPA-like rule (issue 48).

    python bench/planner_sim.py                      # the full comparison -> bench/results/planner/
    python bench/planner_sim.py --minutes 10 --quick # a short look

What is simulated
- Prefill engines: a FIFO queue of prompts, served in steps of at most `max_batched_tokens`
  tokens (chunked prefill), each step taking p0 + p1*tokens + p2*sum(new x context) seconds.
- Decode engines: a batch of streams (at most `max_batch`, and as many as the KV cache holds),
  each step taking a + b*batch + c*sum(context) seconds; simulated in 0.25 s slices (a slice
  runs slice/step steps).
- Every step's time is the calibrated model times a log-normal noise (sigma 0.1): the planner
  never sees the true coefficients; it starts from its priors and fits what the engines report.
- A router: a new prompt goes to the ready prefill engine with the fewest queued tokens, a
  prefilled request to the ready decode engine with the fewest streams; draining engines take
  nothing new. A replica asked for starts serving 2-5 minutes later (uniform), and costs from
  the moment it is asked for. A replica removed is drained first (the product's preStop drain:
  up to `drain_timeout`), what it still runs then migrates: a decode stream continues on another
  decode engine after a re-prefill of its context, a queued prompt goes to another prefill.
- The engines keep the counters, gauges, latency sums and step totals a real engine reports in
  /v1/loads and /metrics; the planner reads them through the same code the operator uses
  (dsv4_operator.planner.observe) and decides with the same pure function (decision.decide).

Calibration (how the timing model comes from dsv4's own results): `calibrate()` reads
- bench/results/serve-native/serve.json: the engine's own mean ITL (engine_view.itl_mean_ms) at 1, 8
  and 32 streams of 128-token prompts + 64 new tokens, and the multiround workload (8 streams,
  contexts 128-512): a least-squares fit of the decode step a + b*batch + c*batch*context;
- bench/results/prefix.json (ours-nocache): the time to first token of one prompt alone at 512,
  592, 672 and 752 tokens (conversation rounds) and of a 1,520-token prompt (warm_vs_cold), plus
  serve-native's 128-token TTFT at one stream: a least-squares fit of p0 + p1*L + p2*L^2, the
  prefill step of one prompt of L tokens.
Both are the mla512 preset (DeepSeek-V3 shapes at kv_lora_rank 512) on the project's 2-core CPU
machine: one simulated replica is one such engine (KV pool and batch limits as those runs had),
and the request rates are sized so the fleet needs a few to a dozen replicas per role.

The trace (60 minutes, a day compressed): a diurnal rate from the trough to 4x at minute 30 and
back; three bursts of 3x the rate at that moment, of 3-4 minutes each with 30-second ramps;
the request mix moving between tool-result-heavy (long prompts, short answers) and
reasoning-heavy (short prompts, long answers) on a 40-minute cycle.

SLA: a request meets it when its TTFT <= the TTFT target and its mean ITL (decode time over its
tokens after the first) <= the ITL target; a minute meets it when at least 90% of the requests
that arrived in it do (a minute with no request meets it).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

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

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SLICE = 0.25  # seconds of simulated time per decode slice
TRANSFER_S = 0.02  # KV hand-off from prefill to decode
NOISE = 0.1
MINUTE_MET_SHARE = 0.9


# ---- calibration -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    decode: tuple[float, float, float]  # a, b, c (seconds; per stream; per stream-token of context)
    prefill: tuple[float, float, float]  # p0, p1, p2 (seconds; per token; per token x context)
    kv_tokens: int  # KV cache of one decode replica, tokens
    max_batch: int
    max_batched_tokens: int
    points: dict = field(default_factory=dict)

    def decode_step(self, batch: int, context_sum: float) -> float:
        a, b, c = self.decode
        return a + b * batch + c * context_sum

    def prefill_step(self, tokens: float, token_context: float) -> float:
        p0, p1, p2 = self.prefill
        return p0 + p1 * tokens + p2 * token_context


def calibrate(results: Path = RESULTS) -> Timing:
    serve = json.loads((results / "serve-native" / "serve.json").read_text())
    prefix = json.loads((results / "prefix.json").read_text())
    settings = serve["settings"]
    prompt, new = settings["prompt_len"], settings["new_tokens"]
    work = serve["ours"]["workloads"]
    dec_points = []  # (batch, mean context, step seconds)
    for name in ("c1", "c8", "c32"):
        batch = int(name[1:])
        dec_points.append((batch, prompt + new / 2, work[name]["engine_view"]["itl_mean_ms"] / 1000))
    multi = next(w for w in serve["workloads"] if w["kind"] == "multiround")
    ctx = sum(multi["context_lens"]) / len(multi["context_lens"]) + new / 2
    dec_points.append((multi["concurrency"], ctx, work["multiround"]["engine_view"]["itl_mean_ms"] / 1000))
    x = np.array([[1.0, b, b * c] for b, c, _ in dec_points])
    y = np.array([s for _, _, s in dec_points])
    decode = np.linalg.lstsq(x, y, rcond=None)[0]

    pre_points = [(prompt, work["c1"]["engine_view"]["ttft_mean_ms"] / 1000)]
    side = prefix["sides"]["ours-nocache"]
    for length, ms in zip(
        side["conversation"]["prompt_tokens_per_round"], side["conversation"]["ttft_p50_ms_per_round"]
    ):
        pre_points.append((length, ms / 1000))
    ps = prefix["settings"]
    pre_points.append((ps["prefix_len"] + ps["suffix_len"], side["warm_vs_cold"]["cold_ttft_ms"] / 1000))
    x = np.array([[1.0, n, n * n] for n, _ in pre_points])
    y = np.array([s for _, s in pre_points])
    prefill = np.linalg.lstsq(x, y, rcond=None)[0]
    page = serve["model"]["kv_page_size"]
    return Timing(
        decode=tuple(max(0.0, float(v)) for v in decode),
        prefill=tuple(max(0.0, float(v)) for v in prefill),
        kv_tokens=int(settings["kv_pages"]) * int(page),
        max_batch=int(settings["max_num_seqs"]),
        max_batched_tokens=int(prefix["settings"]["max_num_batched_tokens"]),
        points={"decode": dec_points, "prefill": pre_points},
    )


# ---- the trace ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceSpec:
    minutes: float = 60.0
    trough_rps: float = 0.5
    peak_ratio: float = 4.0
    bursts: tuple[tuple[float, float], ...] = ((13.0, 3.5), (29.0, 3.0), (46.0, 4.0))  # (start minute, minutes)
    burst_ratio: float = 3.0
    burst_ramp_s: float = 30.0
    mix_period_min: float = 40.0
    tool_prompt: float = 1200.0
    tool_output: float = 120.0
    reason_prompt: float = 300.0
    reason_output: float = 700.0
    seed: int = 1


def diurnal(t_s: float, spec: TraceSpec) -> float:
    phase = t_s / (spec.minutes * 60.0)
    return 1.0 + (spec.peak_ratio - 1.0) * 0.5 * (1 - math.cos(2 * math.pi * phase))


def burst(t_s: float, spec: TraceSpec) -> float:
    m = 1.0
    for start, length in spec.bursts:
        a, b = start * 60.0, (start + length) * 60.0
        ramp = spec.burst_ramp_s
        if a <= t_s < b:
            rise = min(1.0, (t_s - a) / ramp, (b - t_s) / ramp)
            m = max(m, 1.0 + (spec.burst_ratio - 1.0) * rise)
    return m


def tool_share(t_s: float, spec: TraceSpec) -> float:
    """The share of tool-result-heavy requests: 0.15 .. 0.85 on the mix's cycle."""
    return 0.5 + 0.35 * math.sin(2 * math.pi * t_s / (spec.mix_period_min * 60.0))


def rate(t_s: float, spec: TraceSpec) -> float:
    return spec.trough_rps * diurnal(t_s, spec) * burst(t_s, spec)


@dataclass
class Request:
    rid: int
    arrival: float
    prompt: int
    output: int
    prefilled: int = 0
    first_token: Optional[float] = None
    generated: float = 0.0
    decode_time: float = 0.0
    done: Optional[float] = None
    migrations: int = 0


def make_trace(spec: TraceSpec) -> list[Request]:
    rng = random.Random(spec.seed)
    out, t, peak = [], 0.0, spec.trough_rps * spec.peak_ratio * spec.burst_ratio
    end = spec.minutes * 60.0
    while True:  # a thinned Poisson process
        t += rng.expovariate(peak)
        if t >= end:
            break
        if rng.random() * peak > rate(t, spec):
            continue
        tool = rng.random() < tool_share(t, spec)
        mp, mo = (spec.tool_prompt, spec.tool_output) if tool else (spec.reason_prompt, spec.reason_output)
        prompt = max(16, int(rng.lognormvariate(math.log(mp) - 0.08, 0.4)))  # mean mp, a spread of 0.4
        output = max(2, int(rng.lognormvariate(math.log(mo) - 0.08, 0.4)))
        out.append(Request(len(out), t, prompt, output))
    return out


# ---- engines --------------------------------------------------------------------------------------


class Engine:
    def __init__(self, role: str, ordinal: int, created: float, ready_at: float, timing: Timing, rng: random.Random):
        self.role, self.ordinal, self.created, self.ready_at = role, ordinal, created, ready_at
        self.timing, self.rng = timing, rng
        self.draining_since: Optional[float] = None
        self.removed: Optional[float] = None
        self.clock = ready_at  # prefill: when the engine is free next
        self.queue: list[Request] = []  # prefill: FIFO of prompts; decode: streams waiting for room
        self.running: list[Request] = []  # decode
        # what a real engine reports
        self.prompt_tokens = 0.0
        self.generation_tokens = 0.0
        self.ttft_sum = self.ttft_count = 0.0
        self.itl_sum = self.itl_count = 0.0
        self.steps = {"decode": dict.fromkeys(STEP_KEYS, 0.0), "prefill": dict.fromkeys(STEP_KEYS, 0.0)}

    name = property(lambda self: f"{self.role}-{self.ordinal}")

    def ready(self, now: float) -> bool:
        return self.removed is None and now >= self.ready_at

    def serving(self, now: float) -> bool:
        return self.ready(now) and self.draining_since is None

    def noise(self) -> float:
        return math.exp(self.rng.gauss(-NOISE * NOISE / 2, NOISE))

    def context_sum(self) -> float:
        return sum(r.prompt + r.generated for r in self.running)

    def idle(self) -> bool:
        return not self.queue and not self.running

    def reading(self, now: float) -> Reading:
        queued = sum(r.prompt - r.prefilled for r in self.queue) if self.role == "prefill" else 0.0
        ctx = self.context_sum()
        return Reading(
            time=now,
            running=float(len(self.running)),
            waiting=float(len(self.queue)),
            queued_prompt_tokens=float(queued),
            running_context_tokens=ctx,
            kv_tokens_total=float(self.timing.kv_tokens),
            kv_tokens_used=ctx,
            max_batch=float(self.timing.max_batch),
            max_batched_tokens=float(self.timing.max_batched_tokens),
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            ttft_sum=self.ttft_sum,
            ttft_count=self.ttft_count,
            itl_sum=self.itl_sum,
            itl_count=self.itl_count,
            steps={k: dict(v) for k, v in self.steps.items()},
            draining=self.draining_since is not None,
        )


STEP_KEYS = ("steps", "seconds", "requests", "tokens", "request_context", "token_context")


class Fleet:
    """Engines of both roles, the router, and the bookkeeping of cost and SLA."""

    def __init__(self, timing: Timing, ttft_target: float, itl_target: float, drain_timeout: float, seed: int):
        self.timing = timing
        self.ttft_target, self.itl_target, self.drain_timeout = ttft_target, itl_target, drain_timeout
        self.rng = random.Random(seed)
        self.engines: dict[str, list[Engine]] = {"prefill": [], "decode": []}
        self.router_queue: list[Request] = []  # prompts waiting for a serving prefill engine
        self.handoff: list[tuple[float, Request]] = []  # (time, request) prefilled, going to decode
        self.done: list[Request] = []
        self.count_log: list[tuple[float, int, int, int, int]] = []  # (t, prefill, decode, ready p, ready d)

    # -- replicas
    def live(self, role: str) -> list[Engine]:
        return [e for e in self.engines[role] if e.removed is None]

    def replicas(self, role: str) -> int:
        return len(self.live(role))

    def add(self, role: str, now: float, startup: Optional[float] = None) -> Engine:
        ordinal = max((e.ordinal for e in self.live(role)), default=-1) + 1
        delay = self.rng.uniform(120.0, 300.0) if startup is None else startup
        e = Engine(role, ordinal, now, now + delay, self.timing, random.Random(self.rng.random()))
        self.engines[role].append(e)
        return e

    def set_replicas(self, role: str, n: int, now: float, remove_now: bool = False) -> None:
        """As a StatefulSet: more pods get the next ordinals; fewer take the highest ordinals away
        (drained first, as the engines' preStop hook does, unless `remove_now`: already drained)."""
        live = self.live(role)
        if remove_now:
            for e in sorted(live, key=lambda e: -e.ordinal)[: max(0, len(live) - n)]:
                self.remove(e, now)
            return
        kept = [e for e in live if e.draining_since is None]
        for _ in range(n - len(kept)):
            self.add(role, now)
        for e in sorted(kept, key=lambda e: -e.ordinal)[: max(0, len(kept) - n)]:
            e.draining_since = now

    def drain(self, role: str, names: list[str], now: float) -> None:
        for e in self.live(role):
            if e.name in names and e.draining_since is None:
                e.draining_since = now

    def remove(self, e: Engine, now: float) -> None:
        e.removed = now
        for r in e.queue + e.running:
            r.migrations += 1
        if e.role == "prefill":
            for r in e.queue:
                r.prefilled = 0
                self.router_queue.append(r)
        else:
            for r in e.queue + e.running:
                # continues elsewhere after a re-prefill of its context (counted in its decode time)
                pause = self.timing.prefill_step(r.prompt + r.generated, (r.prompt + r.generated) ** 2)
                r.decode_time += pause
                self.handoff.append((now + pause, r))
        e.queue, e.running = [], []

    # -- serving
    def route_prefill(self, r: Request, now: float) -> bool:
        serving = [e for e in self.engines["prefill"] if e.serving(now)]
        if not serving:
            return False
        e = min(serving, key=lambda e: sum(q.prompt - q.prefilled for q in e.queue))
        e.queue.append(r)
        e.prompt_tokens += r.prompt
        return True

    def route_decode(self, r: Request, now: float) -> bool:
        serving = [e for e in self.engines["decode"] if e.serving(now)]
        if not serving:
            return False
        e = min(serving, key=lambda e: len(e.running) + len(e.queue))
        e.queue.append(r)
        e.prompt_tokens += r.prompt
        return True

    def run_prefill(self, e: Engine, now: float, until: float) -> None:
        t = self.timing
        while e.queue and e.removed is None:
            start = max(e.clock, e.ready_at, now)
            if start >= until:
                return
            budget, tokens, token_ctx, finished, reqs = t.max_batched_tokens, 0, 0.0, [], 0
            for r in e.queue:
                if budget <= 0:
                    break
                new = min(budget, r.prompt - r.prefilled)
                r.prefilled += new
                tokens += new
                token_ctx += new * r.prefilled
                budget -= new
                reqs += 1
                if r.prefilled >= r.prompt:
                    finished.append(r)
            took = t.prefill_step(tokens, token_ctx) * e.noise()
            e.clock = start + took
            s = e.steps["prefill"]
            s["steps"] += 1
            s["seconds"] += took
            s["requests"] += reqs
            s["tokens"] += tokens
            s["token_context"] += token_ctx
            for r in finished:
                e.queue.remove(r)
                r.first_token = e.clock + TRANSFER_S
                e.ttft_sum += e.clock - r.arrival
                e.ttft_count += 1
                e.generation_tokens += 1
                self.handoff.append((r.first_token, r))

    def run_decode(self, e: Engine, now: float, dt: float) -> None:
        t = self.timing
        while e.queue:  # admit streams while the batch and the KV cache have room
            r = e.queue[0]
            if len(e.running) >= t.max_batch or e.context_sum() + r.prompt + r.output > t.kv_tokens:
                break
            e.running.append(e.queue.pop(0))
        for r in e.queue:  # waiting for room: the wait is part of its next token's gap
            r.decode_time += dt
        if not e.running:
            return
        batch, ctx = len(e.running), e.context_sum()
        step = t.decode_step(batch, ctx) * e.noise()
        k = dt / step
        s = e.steps["decode"]
        s["steps"] += k
        s["seconds"] += dt
        s["requests"] += k * batch
        s["tokens"] += k * batch
        s["request_context"] += k * ctx
        keep = []
        for r in e.running:
            left = r.output - 1 - r.generated
            n = min(k, left)
            r.generated += n
            r.decode_time += n * step
            e.generation_tokens += n
            e.itl_sum += n * step
            e.itl_count += n
            if r.generated >= r.output - 1 - 1e-9:
                r.done = now + n * step
                self.done.append(r)
            else:
                keep.append(r)
        e.running = keep

    def tick(self, now: float, dt: float) -> None:
        end = now + dt
        pending, self.router_queue = self.router_queue, []
        for r in pending:
            if not self.route_prefill(r, now):
                self.router_queue.append(r)
        for e in self.engines["prefill"]:
            if e.removed is None:
                self.run_prefill(e, now, end)
        still = []
        for when, r in self.handoff:
            if when > end or not self.route_decode(r, now):
                still.append((when, r))
        self.handoff = still
        for e in self.engines["decode"]:
            if e.ready(now):
                self.run_decode(e, now, dt)
        for role in ("prefill", "decode"):  # drained engines leave once idle or out of time
            for e in self.live(role):
                if e.draining_since is not None and (
                    e.idle() or now - e.draining_since >= self.drain_timeout or not e.ready(now)
                ):
                    self.remove(e, now)

    # -- results
    def replica_minutes(self, end: float) -> dict[str, float]:
        out = {}
        for role, engines in self.engines.items():
            out[role] = (
                sum(min(end, e.removed if e.removed is not None else end) - min(end, e.created) for e in engines) / 60
            )
        return out


def minute_attainment(requests: list[Request], minutes: int, ttft_target: float, itl_target: float) -> list[dict]:
    rows = [{"minute": m, "requests": 0, "met": 0, "ttft_p90": None, "itl_p90": None} for m in range(minutes)]
    ttfts: list[list[float]] = [[] for _ in range(minutes)]
    itls: list[list[float]] = [[] for _ in range(minutes)]
    for r in requests:
        m = int(r.arrival // 60)
        if m >= minutes:
            continue
        ttft = (r.first_token - r.arrival) if r.first_token is not None else 1e9
        itl = r.decode_time / max(1, r.output - 1) if r.done is not None else 1e9
        rows[m]["requests"] += 1
        rows[m]["met"] += int(ttft <= ttft_target and itl <= itl_target)
        ttfts[m].append(ttft)
        itls[m].append(itl)
    for m, row in enumerate(rows):
        row["share_met"] = row["met"] / row["requests"] if row["requests"] else 1.0
        row["sla_met"] = row["share_met"] >= MINUTE_MET_SHARE
        if ttfts[m]:
            row["ttft_p90"] = float(np.percentile(ttfts[m], 90))
            row["itl_p90"] = float(np.percentile(itls[m], 90))
    return rows


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

    def __init__(self, settings: Settings, initial: dict):
        self.settings, self.initial = settings, initial
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
        decision = decide(obs, self.state, self.settings, now)
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
    policy: Policy, trace: list[Request], timing: Timing, spec: TraceSpec, ttft: float, itl: float, seed: int = 7
) -> dict:
    import copy

    trace = copy.deepcopy(trace)
    fleet = Fleet(timing, ttft, itl, drain_timeout=120.0, seed=seed)
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
    spec = TraceSpec(minutes=args.minutes, seed=args.seed)
    if args.minutes < 60:
        scale = args.minutes / 60
        spec = TraceSpec(
            minutes=args.minutes,
            seed=args.seed,
            bursts=tuple((s * scale, l) for s, l in spec.bursts),
            mix_period_min=40 * scale,
        )
    if args.random_bursts is not None:
        rng = random.Random(args.random_bursts)
        starts = sorted(rng.uniform(2.0, args.minutes - 6.0) for _ in range(3))
        lengths = [rng.uniform(3.0, 4.0) for _ in range(3)]
        spec = TraceSpec(
            **{**spec.__dict__, "bursts": tuple((round(a, 1), round(b, 1)) for a, b in zip(starts, lengths))}
        )
    trace = make_trace(spec)
    log = lambda s: print(s, file=sys.stderr, flush=True)
    log(f"calibrated: decode {timing.decode}, prefill {timing.prefill}; {len(trace)} requests")
    lo, hi = {"prefill": 1, "decode": 1}, {"prefill": args.max_replicas, "decode": args.max_replicas}
    settings = Settings(
        interval_s=30.0,
        ttft_target_s=args.ttft,
        itl_target_s=args.itl,
        min_replicas=lo,
        max_replicas=hi,
        drain_timeout_s=120.0,
        startup_s=180.0,
        max_unavailable={"prefill": 2, "decode": 2},
        burst_factor=args.burst_factor,
    )
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
    (args.out / "planner_sim.json").write_text(json.dumps(report, indent=1, default=float))
    runs = {"planner": planner, "hpa": hpa, **({"static": static} if static else {})}
    plot(report, runs, spec, args.out / "planner_sim.png")
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
