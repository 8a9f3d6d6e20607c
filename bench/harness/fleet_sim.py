"""A simulated PD fleet for the planner's benchmark (bench/suites/planner_sim.py): the timing model
calibrated from dsv4's own results, the trace, prefill and decode engines that report what real
engines report, the router between them, and the SLA per minute.

- Prefill engines: a FIFO queue of prompts, served in steps of at most `max_batched_tokens`
  tokens (chunked prefill), each step taking p0 + p1*tokens + p2*sum(new x context) seconds.
- Decode engines: a batch of streams (at most `max_batch`, and as many as the KV cache holds),
  each step taking a + b*batch + c*sum(context) seconds; simulated in 0.25 s slices (a slice
  runs slice/step steps).
- Every step's time is the calibrated model times a log-normal noise (sigma 0.1).
- A router: a new prompt goes to the ready prefill engine with the fewest queued tokens, a
  prefilled request to the ready decode engine with the fewest streams; draining engines take
  nothing new. A replica asked for starts serving 2-5 minutes later (uniform; `startup_s`), and costs from
  the moment it is asked for. A replica removed is drained first (the product's preStop drain:
  up to `drain_timeout`), what it still runs then migrates: a decode stream continues on another
  decode engine after a re-prefill of its context, a queued prompt goes to another prefill.
- The engines keep the counters, gauges, latency sums and step totals a real engine reports in
  /v1/loads and /metrics (`Engine.reading`, read by dsv4_operator.planner.observe).

Calibration (how the timing model comes from dsv4's own results): `calibrate()` reads
- bench/results/serve-native/serve.json: the engine's own mean ITL (engine_view.itl_mean_ms) at 1, 8
  and 32 streams of 128-token prompts + 64 new tokens, and the multiround workload (8 streams,
  contexts 128-512): a least-squares fit of the decode step a + b*batch + c*batch*context;
- bench/results/prefix.json (ours-nocache): the time to first token of one prompt alone at 512,
  592, 672 and 752 tokens (conversation rounds) and of a 1,520-token prompt (warm_vs_cold), plus
  serve-native's 128-token TTFT at one stream: a least-squares fit of p0 + p1*L + p2*L^2, the
  prefill step of one prompt of L tokens.
Both are the mla512 preset (DeepSeek-V3 shapes at kv_lora_rank 512) on the project's 2-core CPU
machine: one simulated replica is one such engine (KV pool and batch limits as those runs had).

SLA: a request meets it when its TTFT <= the TTFT target and its mean ITL (decode time over its
tokens after the first) <= the ITL target; a minute meets it when at least 90% of the requests
that arrived in it do (a minute with no request meets it).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from bench import RESULTS
from dsv4_operator.planner.observe import Reading

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

    def __init__(
        self,
        timing: Timing,
        ttft_target: float,
        itl_target: float,
        drain_timeout: float,
        seed: int,
        startup_s: tuple[float, float] = (120.0, 300.0),
    ):
        self.timing, self.startup_s = timing, startup_s
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
        delay = self.rng.uniform(*self.startup_s) if startup is None else startup
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
