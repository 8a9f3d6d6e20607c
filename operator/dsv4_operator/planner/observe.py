"""Pure: what the planner reads from one engine, and its load over an interval.

A `Reading` is one scrape (cumulative counters and live gauges) of /v1/loads and /metrics; two
readings of the same engine incarnation make an `EngineLoad`: rates, means and step totals over
the interval between them. The metric names read are the engines' contract (docs/operations.md,
"Metrics for external autoscalers" lists them for HPA/KEDA users as well).

Builtin engines report everything in /v1/loads (queues, KV pages, counters, the planner's
fields `queued_prompt_tokens`, `running_context_tokens`, `steps`) and the latency histograms in
/metrics. SGLang engines report queues, KV tokens and counters in /metrics, no step totals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from dsv4_wire import metric_name

BUILTIN, SGLANG = "builtin", "sglang"

TTFT = "time_to_first_token_seconds"
ITL = "inter_token_latency_seconds"
# (builtin name, SGLang name) of each series read from /metrics; histograms by their base name.
SERIES = {
    "running": (metric_name("num_running_reqs"), "sglang:num_running_reqs"),
    "waiting": (metric_name("num_queue_reqs"), "sglang:num_queue_reqs"),
    "prompt_tokens": (metric_name("prompt_tokens", "_total"), "sglang:prompt_tokens_total"),
    "generation_tokens": (metric_name("generation_tokens", "_total"), "sglang:generation_tokens_total"),
    "kv_pages_free": (metric_name("kv_pages_free"), None),
    "kv_pages_total": (metric_name("kv_pages_total"), "sglang:max_total_num_tokens"),
    "kv_used_tokens": (None, "sglang:num_used_tokens"),
    "ttft_sum": (metric_name(TTFT, "_sum"), f"sglang:{TTFT}_sum"),
    "ttft_count": (metric_name(TTFT, "_count"), f"sglang:{TTFT}_count"),
    "itl_sum": (metric_name(ITL, "_sum"), f"sglang:{ITL}_sum"),
    "itl_count": (metric_name(ITL, "_count"), f"sglang:{ITL}_count"),
}


def scan_metrics(text: str, kind: str = BUILTIN) -> dict[str, float]:
    """The series of SERIES found in a Prometheus text exposition, each summed over its label sets
    (tensor-parallel ranks report one each). A line that does not parse is skipped."""
    column = 1 if kind == SGLANG else 0
    wanted = {names[column]: key for key, names in SERIES.items() if names[column]}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace, space = line.find("{"), line.find(" ")
        if space < 0:
            continue
        name = line[: brace if 0 <= brace < space else space]
        key = wanted.get(name)
        if key is None:
            continue
        parts = line[line.rfind("}") + 1 if brace >= 0 else space :].split()
        try:
            value = float(parts[0])
        except (IndexError, ValueError):
            continue
        if math.isfinite(value):
            out[key] = out.get(key, 0.0) + value
    return out


@dataclass(frozen=True)
class Reading:
    """One scrape of one engine."""

    time: float
    running: float = 0.0  # requests in the running batch
    waiting: float = 0.0  # requests queued on the engine (scheduler queue and the PD queues before it)
    queued_prompt_tokens: Optional[float] = None
    running_context_tokens: Optional[float] = None
    kv_tokens_total: Optional[float] = None
    kv_tokens_used: Optional[float] = None
    max_batch: Optional[float] = None
    max_batched_tokens: Optional[float] = None
    prompt_tokens: Optional[float] = None
    generation_tokens: Optional[float] = None
    ttft_sum: Optional[float] = None
    ttft_count: Optional[float] = None
    itl_sum: Optional[float] = None
    itl_count: Optional[float] = None
    steps: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    draining: bool = False


def _num(value: Any) -> Optional[float]:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def reading(
    now: float, loads: Optional[Mapping[str, Any]], metrics_text: Optional[str], kind: str = BUILTIN
) -> Reading:
    """One engine's scrape -> a Reading (live gauges from /v1/loads where it has them)."""
    m = scan_metrics(metrics_text or "", kind)
    loads = loads if isinstance(loads, Mapping) else {}
    queues = loads.get("queues") if isinstance(loads.get("queues"), Mapping) else {}
    counters = loads.get("counters") if isinstance(loads.get("counters"), Mapping) else {}
    running = _num(queues.get("running"))
    waiting_parts = [_num(queues.get(k)) for k in ("waiting", "bootstrap", "prealloc", "transfer")]
    waiting = sum(v for v in waiting_parts if v is not None) if any(v is not None for v in waiting_parts) else None
    page_size = _num(loads.get("kv_page_size")) or 1.0
    total_pages, free_pages = _num(loads.get("kv_pages_total")), _num(loads.get("kv_pages_free"))
    if total_pages is None and kind == BUILTIN:
        total_pages, free_pages = m.get("kv_pages_total"), m.get("kv_pages_free")
    kv_total = kv_used = None
    if total_pages is not None:
        kv_total = total_pages * page_size
        kv_used = None if free_pages is None else max(0.0, total_pages - free_pages) * page_size
    elif kind == SGLANG and "kv_pages_total" in m:  # SGLang reports tokens, not pages
        kv_total, kv_used = m["kv_pages_total"], m.get("kv_used_tokens")
    steps = loads.get("steps") if isinstance(loads.get("steps"), Mapping) else {}
    return Reading(
        time=now,
        running=running if running is not None else m.get("running", 0.0),
        waiting=waiting if waiting is not None else m.get("waiting", 0.0),
        queued_prompt_tokens=_num(loads.get("queued_prompt_tokens")),
        running_context_tokens=_num(loads.get("running_context_tokens")),
        kv_tokens_total=kv_total,
        kv_tokens_used=kv_used,
        max_batch=_num(loads.get("max_num_seqs")),
        max_batched_tokens=_num(loads.get("max_num_batched_tokens")),
        prompt_tokens=_num(counters.get("prompt_tokens")) if "prompt_tokens" in counters else m.get("prompt_tokens"),
        generation_tokens=(
            _num(counters.get("generation_tokens")) if "generation_tokens" in counters else m.get("generation_tokens")
        ),
        ttft_sum=m.get("ttft_sum"),
        ttft_count=m.get("ttft_count"),
        itl_sum=m.get("itl_sum"),
        itl_count=m.get("itl_count"),
        steps={k: dict(v) for k, v in steps.items() if isinstance(v, Mapping)},
        draining=bool(loads.get("draining")),
    )


@dataclass(frozen=True)
class EngineLoad:
    """One engine over one interval (the planner's input). Rates are per second; None: unknown."""

    pod: str
    role: str
    seconds: float
    ready: bool = True
    draining: bool = False
    running: float = 0.0  # at the end of the interval
    waiting: float = 0.0
    queued_prompt_tokens: Optional[float] = None
    context: Optional[float] = None  # mean context of a running request (tokens)
    kv_tokens_total: Optional[float] = None
    kv_tokens_used: Optional[float] = None
    max_batch: Optional[float] = None
    max_batched_tokens: Optional[float] = None
    prompt_tokens_per_s: Optional[float] = None
    generation_tokens_per_s: Optional[float] = None
    ttft_s: Optional[float] = None  # mean over the requests that got their first token in the interval
    ttft_n: float = 0.0
    itl_s: Optional[float] = None
    itl_n: float = 0.0
    steps: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # per kind: totals over the interval


def _delta(new: Optional[float], old: Optional[float]) -> Optional[float]:
    if new is None or old is None or new < old:  # a counter that went down: the engine restarted
        return None
    return new - old


def _mean(
    s1: Optional[float], s0: Optional[float], c1: Optional[float], c0: Optional[float]
) -> tuple[Optional[float], float]:
    ds, dc = _delta(s1, s0), _delta(c1, c0)
    if ds is None or not dc:
        return None, 0.0
    return ds / dc, dc


def engine_load(
    pod: str, role: str, before: Optional[Reading], now: Reading, *, ready: bool = True, draining: bool = False
) -> EngineLoad:
    """The load of one engine between two readings (`before` None: the first reading, gauges only)."""
    context = None
    if now.running_context_tokens is not None and now.running > 0:
        context = now.running_context_tokens / now.running
    elif now.kv_tokens_used is not None and now.running > 0:
        context = now.kv_tokens_used / now.running
    out = EngineLoad(
        pod=pod,
        role=role,
        seconds=0.0 if before is None else max(0.0, now.time - before.time),
        ready=ready,
        draining=draining or now.draining,
        running=now.running,
        waiting=now.waiting,
        queued_prompt_tokens=now.queued_prompt_tokens,
        context=context,
        kv_tokens_total=now.kv_tokens_total,
        kv_tokens_used=now.kv_tokens_used,
        max_batch=now.max_batch,
        max_batched_tokens=now.max_batched_tokens,
    )
    if before is None or out.seconds <= 0:
        return out
    dt = out.seconds
    prompt = _delta(now.prompt_tokens, before.prompt_tokens)
    gen = _delta(now.generation_tokens, before.generation_tokens)
    ttft, ttft_n = _mean(now.ttft_sum, before.ttft_sum, now.ttft_count, before.ttft_count)
    itl, itl_n = _mean(now.itl_sum, before.itl_sum, now.itl_count, before.itl_count)
    steps: dict[str, dict[str, float]] = {}
    for kind, totals in now.steps.items():
        old = before.steps.get(kind) or {}
        diff = {k: _delta(_num(v), _num(old.get(k, 0.0))) for k, v in totals.items()}
        if all(v is not None for v in diff.values()):
            steps[kind] = {k: float(v) for k, v in diff.items() if v is not None}
    return EngineLoad(
        **{
            **out.__dict__,
            "prompt_tokens_per_s": None if prompt is None else prompt / dt,
            "generation_tokens_per_s": None if gen is None else gen / dt,
            "ttft_s": ttft,
            "ttft_n": ttft_n,
            "itl_s": itl,
            "itl_n": itl_n,
            "steps": steps,
        }
    )
