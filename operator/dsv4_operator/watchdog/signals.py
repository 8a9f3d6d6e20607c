"""One scrape of one engine, reduced to the numbers the wedge detector reads.

Two sources per scrape: the Prometheus text of ``/metrics`` and the JSON of ``/v1/loads``.
Gauges come from ``/v1/loads`` when it has them, because it is the live view (SGLang writes its
PD gauges only when a batch runs, so an idle wedged prefill shows a stale count there); counters
come from ``/metrics`` and fall back to the ``counters`` object of our own ``/v1/loads``.

Every field of :class:`EngineSample` is ``None`` when no source reported it: the detector treats an
unknown signal as "no evidence", never as zero.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from prometheus_client.parser import text_string_to_metric_families

from dsv4_wire.metrics import metric_name

BUILTIN = "builtin"
SGLANG = "sglang"
ROUTER = "router"  # a dsv4 router's /metrics (its own prefix): the router_* fields only


@dataclass(frozen=True)
class ScrapeTarget:
    """One engine the watchdog reads (the I/O: dsv4_operator.remediation.scrape)."""

    key: str  # the pod's identity for the detector (include its UID: a new pod is a new key)
    base_url: str
    role: str
    kind: str = BUILTIN


GAUGE_FIELDS = (
    "num_running",
    "num_queue",
    "bootstrap_queue",
    "prefill_inflight",
    "decode_prealloc",
    "decode_transfer",
    "prefill_inflight_oldest_age_seconds",
    "kv_pages_free",
    "kv_pages_total",
    "rank_beat_age_seconds",
    "http_waiting",
    "router_held",
    "router_hold_left",
    "router_engine_wait",
)

# Monotonic counters; a value lower than the previous scrape's means the engine restarted.
COUNTER_FIELDS = (
    "transfers_completed",
    "transfer_bytes",
    "transfer_failed",
    "transfer_timeout",
    "bootstrap_failed",
    "generation_tokens",
    "prompt_tokens",
    "aborted",
    "requests_completed",
    "loop_iterations",
    "router_sent",
    "decode_local",
)


@dataclass(frozen=True, slots=True)
class EngineSample:
    timestamp: float
    role: str
    reachable: bool
    kind: str = BUILTIN
    error: str | None = None
    # gauges
    num_running: float | None = None
    num_queue: float | None = None
    bootstrap_queue: float | None = None
    prefill_inflight: float | None = None
    decode_prealloc: float | None = None
    decode_transfer: float | None = None
    prefill_inflight_oldest_age_seconds: float | None = None
    # Reclaimable pages: our engine counts prefix-cached pages no request uses as free (and SGLang
    # leaves evictable radix-cache tokens out of num_used_tokens), so a cache kept warm while
    # idle never reads as pinned pages. No verdict reads these two; evidence reports them.
    kv_pages_free: float | None = None
    kv_pages_total: float | None = None
    # A worker node of a multi-node engine (its node agent's /metrics): the oldest heartbeat among
    # its ranks; one that stopped (a rank frozen) grows without end.
    rank_beat_age_seconds: float | None = None
    # Requests the engine's HTTP process holds with no output from its core yet (our engine only):
    # with the core idle, clients wait on a hang /health does not see.
    http_waiting: float | None = None
    # A router (kind ROUTER): requests inside it (admitted + queued), and requests sent to engines.
    router_held: float | None = None
    router_sent: float | None = None
    # seconds left of a planned change's hold (router hold.py): requests held then are no wedge
    router_hold_left: float | None = None
    # requests the router holds because no engine (pair) is healthy: waiting on the engines, not stuck in it
    router_engine_wait: float | None = None
    # counters
    transfers_completed: float | None = None
    transfer_bytes: float | None = None
    transfer_failed: float | None = None
    transfer_timeout: float | None = None
    bootstrap_failed: float | None = None
    generation_tokens: float | None = None
    prompt_tokens: float | None = None
    aborted: float | None = None
    requests_completed: float | None = None
    loop_iterations: float | None = None
    # PD rooms decode served from its own prefix cache (--decode-local-prefill): a hand-off by
    # agreement, with no KV moved
    decode_local: float | None = None
    # The hand-off queue counts came from the live view (/v1/loads), not from gauges SGLang sets
    # only when it logs a batch (stale on an idle engine).
    live_queues: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def unreachable_sample(timestamp: float, role: str, kind: str = BUILTIN, error: str | None = None) -> EngineSample:
    return EngineSample(timestamp=timestamp, role=role, reachable=False, kind=kind, error=error)


# --- /metrics ----------------------------------------------------------------------------------
# Sample names (as exposed, with `_total`/`_count` suffixes) -> EngineSample field.  We match on
# *sample* names, not family names: the parser strips `_total` from a counter's family name but
# leaves it on the sample, and an exposition without `# TYPE` lines yields untyped families named
# after the full sample name.  Counters are also accepted without `_total` (untyped old style).


def _with_bare_counters(table: dict[str, str]) -> dict[str, str]:
    out = dict(table)
    for name, field in table.items():
        if name.endswith("_total"):
            out.setdefault(name[: -len("_total")], field)
    return out


_BUILTIN_NAMES = _with_bare_counters(
    {
        metric_name("num_running_reqs"): "num_running",
        metric_name("num_queue_reqs"): "num_queue",
        metric_name("num_prefill_bootstrap_queue_reqs"): "bootstrap_queue",
        metric_name("num_prefill_inflight_queue_reqs"): "prefill_inflight",
        metric_name("num_decode_prealloc_queue_reqs"): "decode_prealloc",
        metric_name("num_decode_transfer_queue_reqs"): "decode_transfer",
        metric_name("prefill_inflight_oldest_age_seconds"): "prefill_inflight_oldest_age_seconds",
        metric_name("kv_pages_free"): "kv_pages_free",
        metric_name("kv_pages_total"): "kv_pages_total",
        metric_name("node_rank_beat_age_seconds"): "rank_beat_age_seconds",
        metric_name("num_http_waiting_reqs"): "http_waiting",
        metric_name("kv_transfers_completed", "_total"): "transfers_completed",
        metric_name("kv_transfer_bytes", "_total"): "transfer_bytes",
        metric_name("num_transfer_failed_reqs", "_total"): "transfer_failed",
        metric_name("num_transfer_timeout_reqs", "_total"): "transfer_timeout",
        metric_name("num_bootstrap_failed_reqs", "_total"): "bootstrap_failed",
        metric_name("generation_tokens", "_total"): "generation_tokens",
        metric_name("prompt_tokens", "_total"): "prompt_tokens",
        metric_name("num_aborted_reqs", "_total"): "aborted",
        metric_name("e2e_request_latency_seconds", "_count"): "requests_completed",
        metric_name("scheduler_loop_iterations", "_total"): "loop_iterations",
        metric_name("num_decode_local_reqs", "_total"): "decode_local",
    }
)

# SGLang: the bootstrap gauge had an older name; completed transfers are the observation count of
# its KV-transfer latency histogram (counted on the sending, prefill side); KV capacity is in
# tokens (max_total_num_tokens / num_used_tokens), reported here in the kv_pages_* fields.
_SGLANG_NAMES = _with_bare_counters(
    {
        "sglang:num_running_reqs": "num_running",
        "sglang:num_queue_reqs": "num_queue",
        "sglang:num_prefill_bootstrap_queue_reqs": "bootstrap_queue",
        "sglang:num_prefill_prealloc_queue_reqs": "bootstrap_queue",
        "sglang:num_prefill_inflight_queue_reqs": "prefill_inflight",
        "sglang:num_decode_prealloc_queue_reqs": "decode_prealloc",
        "sglang:num_decode_transfer_queue_reqs": "decode_transfer",
        "sglang:max_total_num_tokens": "kv_pages_total",
        "sglang:num_used_tokens": "_kv_used",
        "sglang:kv_transfer_latency_ms_count": "transfers_completed",
        "sglang:num_transfer_failed_reqs_total": "transfer_failed",
        "sglang:num_bootstrap_failed_reqs_total": "bootstrap_failed",
        "sglang:generation_tokens_total": "generation_tokens",
        "sglang:prompt_tokens_total": "prompt_tokens",
        "sglang:num_aborted_requests_total": "aborted",
        "sglang:num_requests_total": "requests_completed",
    }
)

_ROUTER_NAMES = {
    "dsv4_router:inflight_requests": "router_held",
    "dsv4_router:queued_requests": "router_held",
    "dsv4_router:worker_requests_total": "router_sent",
    "dsv4_router:planned_hold_seconds": "router_hold_left",
    "dsv4_router:engine_wait_requests": "router_engine_wait",
}

_NAMES = {BUILTIN: _BUILTIN_NAMES, SGLANG: _SGLANG_NAMES, ROUTER: _ROUTER_NAMES}

# Fields where summing over label sets would be wrong: the oldest age is a maximum.
_MAX_FIELDS = frozenset({"prefill_inflight_oldest_age_seconds", "rank_beat_age_seconds"})


_PREFIX = {BUILTIN: "dsv4:", SGLANG: "sglang:", ROUTER: "dsv4_router:"}


def _label_set_end(line: str, brace: int) -> int:
    """Index just past the ``}`` closing the label set opened at ``brace``, or -1 when it never
    closes.  One left-to-right pass with str.find: linear in the line whatever it holds (quoted
    values may contain braces, '#' and escaped quotes).  A regular expression with nested
    repetition here backtracked exponentially on an unclosed label set (issue 27)."""
    i, n, close = brace + 1, len(line), brace
    while i < n:
        if close < i:  # found again only once passed: each character is looked at a bounded number of times
            close = line.find("}", i)
            if close == -1:
                return -1
        quote = line.find('"', i, close)
        if quote == -1 or close < quote:
            return close + 1
        i = quote + 1
        while True:  # to the quote that ends this value: one not escaped by a backslash
            end = line.find('"', i)
            if end == -1:
                return -1
            slashes = 0
            while line[end - 1 - slashes] == "\\":
                slashes += 1
            i = end + 1
            if slashes % 2 == 0:
                break
    return -1


class _Unreadable(ValueError):
    pass


def _add(out: dict[str, float], field: str, value: float) -> None:
    if value != value:  # NaN: no information
        return
    if field in _MAX_FIELDS:
        out[field] = max(out.get(field, value), value)
    else:
        out[field] = out.get(field, 0.0) + value


def _finish(out: dict[str, float]) -> dict[str, float]:
    used = out.pop("_kv_used", None)
    if used is not None and "kv_pages_total" in out:
        out["kv_pages_free"] = max(out["kv_pages_total"] - used, 0.0)
    return out


def _read_wanted(text: str, kind: str) -> dict[str, float]:
    """Label-blind read of the few series we use.  Raises _Unreadable on any wanted line it
    cannot read, so the caller can hand the text to the reference parser instead."""
    names, prefix = _NAMES[kind], _PREFIX[kind]
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            if line[:1] not in (" ", "\t"):
                continue  # comments, other exporters' series
            line = line.lstrip()
            if not line.startswith(prefix):
                continue
        brace = line.find("{")
        name = line[:brace] if brace != -1 else line
        labelled = brace != -1 and " " not in name and "\t" not in name
        if not labelled:
            name = name.split(None, 1)[0]
        field = names.get(name)
        if field is None:
            continue
        if labelled:
            close = line.rfind("}")
            if "#" not in line and close > brace:
                # Nothing after the label set holds a brace (value, timestamp), so the last
                # brace closes it whatever the label values contain.
                rest = line[close + 1 :].split(None, 1)
                token = rest[0] if rest else ""
            else:  # an OpenMetrics exemplar ("# {...}") may follow: read the label set exactly
                end = _label_set_end(line, brace)
                if end == -1:
                    raise _Unreadable(line[:200])
                rest = line[end:].split(None, 1)
                token = rest[0] if rest else ""
        else:
            rest = line.split(None, 2)
            token = rest[1] if len(rest) > 1 else ""
        try:
            value = float(token)
        except ValueError:
            raise _Unreadable(line) from None
        _add(out, field, value)
    return _finish(out)


def parse_metrics_reference(text: str, kind: str = BUILTIN) -> dict[str, float]:
    """The same reduction through prometheus_client's parser over the whole exposition: the
    oracle for :func:`parse_metrics`, and its fallback for text it cannot read."""
    names = _NAMES[kind]
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                field = names.get(sample.name)
                if field is not None:
                    _add(out, field, float(sample.value))
    except ValueError:
        pass  # a malformed exposition: keep what was read before the bad line
    return _finish(out)


def parse_metrics(text: str, kind: str = BUILTIN) -> dict[str, float]:
    """Prometheus text -> {EngineSample field: value}, summed over label sets (per-rank series
    such as SGLang's tp_rank add up), the oldest-inflight age taken as the maximum.

    We key on *sample* names, not family names: prometheus_client's parser strips `_total`
    from a counter's family name but leaves it on the sample, and an exposition without
    `# TYPE` lines yields untyped families named after the full sample name.

    Labels are never read, only skipped, so the common case is a label-blind scan for the
    lines of the series we use: prometheus_client's parser reads labels character by
    character (~30 us a labelled sample here; an SGLang engine with 8 TP ranks exposes ~100 of
    the series we use), which alone would exceed the watchdog's 1 ms per pod per scrape.  Any
    wanted line the scan cannot read sends the whole text through that parser instead.
    """
    try:
        return _read_wanted(text, kind)
    except _Unreadable:
        return parse_metrics_reference(text, kind)


# --- /v1/loads ---------------------------------------------------------------------------------


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return None if value != value else value


_OWN_QUEUE_KEYS = {
    "running": "num_running",
    "waiting": "num_queue",
    "bootstrap": "bootstrap_queue",
    "inflight": "prefill_inflight",
    "prealloc": "decode_prealloc",
    "transfer": "decode_transfer",
}

# Our engine's `counters` object: accept the EngineSample name, the metric's short name with or
# without `_total`, so the engine side can use either spelling.
_OWN_COUNTER_KEYS: dict[str, str] = {}
for _field in COUNTER_FIELDS:
    _OWN_COUNTER_KEYS[_field] = _field
for _metric, _field in _BUILTIN_NAMES.items():
    if _field in COUNTER_FIELDS:
        short = _metric.split(":", 1)[1]
        _OWN_COUNTER_KEYS.setdefault(short, _field)
        if short.endswith("_total"):
            _OWN_COUNTER_KEYS.setdefault(short[: -len("_total")], _field)


def _parse_own_loads(payload: Mapping[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    queues = payload.get("queues")
    if isinstance(queues, Mapping):
        for key, field in _OWN_QUEUE_KEYS.items():
            v = _number(queues.get(key))
            if v is not None:
                out[field] = v
    for key in ("prefill_inflight_oldest_age_seconds", "kv_pages_free", "kv_pages_total"):
        v = _number(payload.get(key))
        if v is not None:
            out[key] = v
    v = _number(payload.get("http_waiting"))
    if v is not None:
        out["http_waiting"] = v
    counters = payload.get("counters")
    if isinstance(counters, Mapping):
        for key, value in counters.items():
            field = _OWN_COUNTER_KEYS.get(key)
            v = _number(value)
            if field is not None and v is not None:
                out["counter:" + field] = out.get("counter:" + field, 0.0) + v
    return out


# SGLang /v1/loads: {"timestamp", "version", "loads": [one object per DP rank]}; each rank has the
# core scalars and, with include=disagg, a "disaggregation" object (null when absent).  The
# bootstrap queue was called prefill_prealloc_queue_reqs in older releases.
_SGLANG_DISAGG_KEYS = {
    "prefill_bootstrap_queue_reqs": "bootstrap_queue",
    "prefill_prealloc_queue_reqs": "bootstrap_queue",
    "prefill_inflight_queue_reqs": "prefill_inflight",
    "decode_prealloc_queue_reqs": "decode_prealloc",
    "decode_transfer_queue_reqs": "decode_transfer",
}


def _parse_sglang_loads(payload: Mapping[str, Any]) -> dict[str, float]:
    loads = payload.get("loads")
    if not isinstance(loads, list):
        return {}
    out: dict[str, float] = {}

    def add(field: str, value: Any) -> None:
        v = _number(value)
        if v is not None:
            out[field] = out.get(field, 0.0) + v

    used_seen = False
    for rank in loads:
        if not isinstance(rank, Mapping):
            continue
        add("num_running", rank.get("num_running_reqs"))
        queues = rank.get("queues")
        # num_waiting_reqs counts the PD queues too in PD mode; queues.waiting is the main queue.
        if isinstance(queues, Mapping) and _number(queues.get("waiting")) is not None:
            add("num_queue", queues.get("waiting"))
        else:
            add("num_queue", rank.get("num_waiting_reqs"))
        add("kv_pages_total", rank.get("max_total_num_tokens"))
        if _number(rank.get("num_used_tokens")) is not None:
            used_seen = True
            add("_kv_used", rank.get("num_used_tokens"))
        disagg = rank.get("disaggregation")
        if isinstance(disagg, Mapping):
            seen: set[str] = set()
            for key, field in _SGLANG_DISAGG_KEYS.items():
                if field not in seen and _number(disagg.get(key)) is not None:
                    seen.add(field)
                    add(field, disagg.get(key))
    used = out.pop("_kv_used", None)
    if used_seen and "kv_pages_total" in out:
        out["kv_pages_free"] = max(out["kv_pages_total"] - (used or 0.0), 0.0)
    return out


def parse_loads(payload: Any, kind: str = BUILTIN) -> dict[str, float]:
    """/v1/loads JSON -> {field: value}; keys of our engine's ``counters`` come back prefixed
    ``counter:`` (a fallback for /metrics).  Tolerates missing keys and wrong types."""
    if not isinstance(payload, Mapping):
        return {}
    if kind == SGLANG or "loads" in payload:
        return _parse_sglang_loads(payload)
    return _parse_own_loads(payload)


def parse_metrics_fast(text: str, kind: str = BUILTIN) -> dict[str, float] | None:
    """:func:`parse_metrics` without the reference parser: None when the scan cannot read a
    wanted line (the caller then parses the whole text where it may take its time)."""
    try:
        return _read_wanted(text, kind)
    except _Unreadable:
        return None


def build_sample(
    timestamp: float,
    role: str,
    kind: str = BUILTIN,
    *,
    metrics_text: str | None = None,
    loads: Any = None,
    error: str | None = None,
    metrics_values: Mapping[str, float] | None = None,
) -> EngineSample:
    """Merge one scrape's two sources into a sample.  Reachable when either source answered.
    ``metrics_values``: ``metrics_text`` already parsed (by :func:`parse_metrics_fast`)."""
    if metrics_text is None and loads is None:
        return unreachable_sample(timestamp, role, kind, error)
    if metrics_values is not None:
        from_metrics = dict(metrics_values)
    else:
        from_metrics = parse_metrics(metrics_text, kind) if metrics_text else {}
    from_loads = parse_loads(loads, kind) if loads is not None else {}
    values: dict[str, float] = {}
    for field in GAUGE_FIELDS:
        v = from_loads.get(field, from_metrics.get(field))
        if v is not None:
            values[field] = v
    for field in COUNTER_FIELDS:
        v = from_metrics.get(field, from_loads.get("counter:" + field))
        if v is not None:
            values[field] = v
    live = any(field in from_loads for field in ("prefill_inflight", "decode_transfer"))
    return EngineSample(
        timestamp=timestamp, role=role, reachable=True, kind=kind, error=error, live_queues=live, **values
    )
