"""Parsing one scrape (Prometheus text + /v1/loads JSON) into an EngineSample."""

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dsv4_operator.watchdog.signals import (
    BUILTIN,
    COUNTER_FIELDS,
    GAUGE_FIELDS,
    SGLANG,
    build_sample,
    parse_loads,
    parse_metrics,
    parse_metrics_reference,
)


def dsv4_metrics_text(role="prefill", inflight=2, age=12.5, completed=7, failed=1) -> str:
    """An engine's /metrics as prometheus_client really writes it (docs/design.md names)."""
    reg = CollectorRegistry()
    labels = ["role", "model_name"]
    lv = (role, "tiny")

    def gauge(name, value):
        Gauge(name, "g", labels, registry=reg).labels(*lv).set(value)

    def counter(name, value):
        Counter(name, "c", labels, registry=reg).labels(*lv).inc(value)

    gauge("dsv4:num_running_reqs", 3)
    gauge("dsv4:num_queue_reqs", 4)
    gauge("dsv4:num_prefill_bootstrap_queue_reqs", 1)
    gauge("dsv4:num_prefill_inflight_queue_reqs", inflight)
    gauge("dsv4:num_decode_prealloc_queue_reqs", 0)
    gauge("dsv4:num_decode_transfer_queue_reqs", 0)
    gauge("dsv4:prefill_inflight_oldest_age_seconds", age)
    gauge("dsv4:kv_pages_free", 100)
    gauge("dsv4:kv_pages_total", 512)
    counter("dsv4:num_bootstrap_failed_reqs_total", 2)
    counter("dsv4:num_transfer_failed_reqs_total", failed)
    counter("dsv4:num_transfer_timeout_reqs_total", 5)
    counter("dsv4:kv_transfers_completed_total", completed)
    counter("dsv4:kv_transfer_bytes_total", 1 << 20)
    counter("dsv4:prompt_tokens_total", 1000)
    counter("dsv4:generation_tokens_total", 50)
    counter("dsv4:num_aborted_reqs_total", 6)
    counter("dsv4:scheduler_loop_iterations_total", 12345)
    h = Histogram("dsv4:e2e_request_latency_seconds", "h", labels, registry=reg)
    for _ in range(9):
        h.labels(*lv).observe(0.5)
    Histogram("dsv4:kv_transfer_latency_seconds", "h", labels, registry=reg).labels(*lv).observe(1)
    return generate_latest(reg).decode()


def test_parser_strips_total_from_counter_family_names():
    # The fact the parser works around: family name without _total, sample name with it.
    text = dsv4_metrics_text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert "dsv4:kv_transfers_completed" in families
    assert "dsv4:kv_transfers_completed_total" not in families
    assert families["dsv4:kv_transfers_completed"].samples[0].name.endswith("_total")


def test_dsv4_metrics_every_signal():
    values = parse_metrics(dsv4_metrics_text(), BUILTIN)
    assert values == {
        "num_running": 3,
        "num_queue": 4,
        "bootstrap_queue": 1,
        "prefill_inflight": 2,
        "decode_prealloc": 0,
        "decode_transfer": 0,
        "prefill_inflight_oldest_age_seconds": 12.5,
        "kv_pages_free": 100,
        "kv_pages_total": 512,
        "bootstrap_failed": 2,
        "transfer_failed": 1,
        "transfer_timeout": 5,
        "transfers_completed": 7,
        "transfer_bytes": 1 << 20,
        "prompt_tokens": 1000,
        "generation_tokens": 50,
        "aborted": 6,
        "loop_iterations": 12345,
        "requests_completed": 9,
    }


def test_untyped_exposition_without_type_lines():
    text = "\n".join(ln for ln in dsv4_metrics_text().splitlines() if not ln.startswith("#"))
    values = parse_metrics(text, BUILTIN)
    assert values["transfers_completed"] == 7
    assert values["prefill_inflight"] == 2


def test_sums_label_sets_and_takes_max_age():
    text = """\
# TYPE dsv4:num_prefill_inflight_queue_reqs gauge
dsv4:num_prefill_inflight_queue_reqs{role="prefill",dp="0"} 2
dsv4:num_prefill_inflight_queue_reqs{role="prefill",dp="1"} 3
# TYPE dsv4:prefill_inflight_oldest_age_seconds gauge
dsv4:prefill_inflight_oldest_age_seconds{dp="0"} 40
dsv4:prefill_inflight_oldest_age_seconds{dp="1"} 7
# TYPE dsv4:kv_transfers_completed counter
dsv4:kv_transfers_completed_total{dp="0"} 10
dsv4:kv_transfers_completed_total{dp="1"} 5
dsv4:kv_transfers_completed_created{dp="0"} 1.7e9
"""
    values = parse_metrics(text, BUILTIN)
    assert values == {"prefill_inflight": 5, "prefill_inflight_oldest_age_seconds": 40, "transfers_completed": 15}


def test_nan_and_unknown_series_ignored():
    text = (
        "dsv4:num_running_reqs NaN\n"
        "dsv4:num_queue_reqs 2\n"
        "process_resident_memory_bytes 1e9\n"
        "dsv4:something_new_total 3\n"
    )
    assert parse_metrics(text, BUILTIN) == {"num_queue": 2}
    assert parse_metrics("", BUILTIN) == {}


# Label values may hold braces, quotes, spaces and '#'; values may be +Inf or carry timestamps.
TRICKY = """\
# TYPE dsv4:num_queue_reqs gauge
dsv4:num_queue_reqs{model_name="a } b",role="p"} 2
dsv4:num_queue_reqs{model_name="say \\"hi\\" {x}",role="d"} 3 1700000000000
dsv4:num_running_reqs +Inf
dsv4:kv_pages_free{a="#"} 5
dsv4:kv_pages_total\t9
dsv4:num_decode_transfer_queue_reqs{a="b"}   -1.5e1
dsv4:kv_transfers_completed_total{role="p"} 7 # {trace_id="abc"} 1.0 1700000000.0
"""


def test_tricky_lines_read_like_the_reference_parser():
    assert (
        parse_metrics(TRICKY)
        == parse_metrics_reference(TRICKY)
        == {
            "num_queue": 5,
            "num_running": float("inf"),
            "kv_pages_free": 5,
            "kv_pages_total": 9,
            "decode_transfer": -15,
            "transfers_completed": 7,
        }
    )


def test_unreadable_line_goes_to_the_reference_parser():
    # An unclosed label set: the scan gives up, prometheus_client's parser reads up to it.
    bad = 'dsv4:num_queue_reqs{role="p"} 2\ndsv4:num_running_reqs{role="p" 3\n'
    assert parse_metrics(bad) == {"num_queue": 2}
    assert parse_metrics('dsv4:num_queue_reqs{role="p"} two\n') == {}


# SGLang as its metrics collector writes it: one series per TP rank, counters with _created,
# a KV-transfer latency histogram; this older release names the bootstrap gauge "prealloc".
SGLANG_METRICS = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="prefill",model_name="dsv4",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 1.0
sglang:num_running_reqs{engine_type="prefill",model_name="dsv4",moe_ep_rank="0",pp_rank="0",tp_rank="1"} 1.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="prefill",model_name="dsv4",tp_rank="0"} 0.0
sglang:num_queue_reqs{engine_type="prefill",model_name="dsv4",tp_rank="1"} 0.0
# TYPE sglang:num_prefill_prealloc_queue_reqs gauge
sglang:num_prefill_prealloc_queue_reqs{engine_type="prefill",model_name="dsv4",tp_rank="0"} 2.0
sglang:num_prefill_prealloc_queue_reqs{engine_type="prefill",model_name="dsv4",tp_rank="1"} 1.0
# TYPE sglang:num_prefill_inflight_queue_reqs gauge
sglang:num_prefill_inflight_queue_reqs{engine_type="prefill",model_name="dsv4",tp_rank="0"} 0.0
sglang:num_prefill_inflight_queue_reqs{engine_type="prefill",model_name="dsv4",tp_rank="1"} 0.0
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{engine_type="prefill",model_name="dsv4",tp_rank="0"} 1000.0
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{engine_type="prefill",model_name="dsv4",tp_rank="0"} 250.0
# HELP sglang:num_transfer_failed_reqs_total The number of transfer failed requests.
# TYPE sglang:num_transfer_failed_reqs_total counter
sglang:num_transfer_failed_reqs_total{engine_type="prefill",model_name="dsv4",tp_rank="0"} 21.0
sglang:num_transfer_failed_reqs_total{engine_type="prefill",model_name="dsv4",tp_rank="1"} 10.0
# TYPE sglang:num_transfer_failed_reqs_created gauge
sglang:num_transfer_failed_reqs_created{engine_type="prefill",model_name="dsv4",tp_rank="0"} 1.7e9
# TYPE sglang:num_bootstrap_failed_reqs_total counter
sglang:num_bootstrap_failed_reqs_total{engine_type="prefill",model_name="dsv4",tp_rank="0"} 1.0
sglang:num_bootstrap_failed_reqs_total{engine_type="prefill",model_name="dsv4",tp_rank="1"} 1.0
# TYPE sglang:kv_transfer_latency_ms histogram
sglang:kv_transfer_latency_ms_bucket{engine_type="prefill",le="10.0",tp_rank="0"} 30.0
sglang:kv_transfer_latency_ms_bucket{engine_type="prefill",le="+Inf",tp_rank="0"} 40.0
sglang:kv_transfer_latency_ms_count{engine_type="prefill",tp_rank="0"} 40.0
sglang:kv_transfer_latency_ms_sum{engine_type="prefill",tp_rank="0"} 400.0
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{engine_type="prefill",model_name="dsv4"} 90000.0
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{engine_type="prefill",model_name="dsv4"} 40.0
# TYPE sglang:num_requests_total counter
sglang:num_requests_total{engine_type="prefill",model_name="dsv4"} 40.0
# TYPE sglang:num_aborted_requests_total counter
sglang:num_aborted_requests_total{engine_type="prefill",model_name="dsv4"} 3.0
"""


def test_sglang_metrics_sum_ranks_and_accept_old_bootstrap_name():
    values = parse_metrics(SGLANG_METRICS, SGLANG)
    assert values["num_running"] == 2
    assert values["bootstrap_queue"] == 3  # older name num_prefill_prealloc_queue_reqs
    assert values["prefill_inflight"] == 0
    assert values["transfer_failed"] == 31
    assert values["bootstrap_failed"] == 2
    assert values["transfers_completed"] == 40  # the latency histogram's count
    assert values["kv_pages_total"] == 1000 and values["kv_pages_free"] == 750
    assert values["prompt_tokens"] == 90000 and values["aborted"] == 3
    assert values["requests_completed"] == 40
    assert "loop_iterations" not in values and "prefill_inflight_oldest_age_seconds" not in values


def test_fast_scan_equals_prometheus_client_parser():
    for text, kind in (
        (dsv4_metrics_text(), BUILTIN),
        (SGLANG_METRICS, SGLANG),
        (dsv4_metrics_text(role="decode", inflight=0, age=0.0), BUILTIN),
    ):
        assert parse_metrics(text, kind) == parse_metrics_reference(text, kind)


def test_sglang_current_bootstrap_name():
    text = SGLANG_METRICS.replace("num_prefill_prealloc_queue_reqs", "num_prefill_bootstrap_queue_reqs")
    assert parse_metrics(text, SGLANG)["bootstrap_queue"] == 3


# /v1/loads?include=disagg: one object per DP rank, core scalars + "disaggregation".
SGLANG_LOADS = {
    "timestamp": "2026-11-29T10:00:00+00:00",
    "version": "0.5.x",
    "loads": [
        {
            "dp_rank": 0,
            "num_running_reqs": 0,
            "num_waiting_reqs": 4,
            "num_used_tokens": 100,
            "max_total_num_tokens": 1000,
            "disaggregation": {
                "mode": "prefill",
                "prefill_bootstrap_queue_reqs": 0,
                "prefill_inflight_queue_reqs": 1,
                "decode_prealloc_queue_reqs": 0,
                "decode_transfer_queue_reqs": 0,
                "decode_retracted_queue_reqs": 0,
                "kv_transfer_speed_gb_s": 0.0,
                "kv_transfer_latency_ms": 0.0,
            },
        },
        {
            "dp_rank": 1,
            "num_running_reqs": 0,
            "num_waiting_reqs": 0,
            "num_used_tokens": 0,
            "max_total_num_tokens": 1000,
            "disaggregation": {"mode": "prefill", "prefill_prealloc_queue_reqs": 2, "prefill_inflight_queue_reqs": 0},
            "queues": {"waiting": 0, "grammar": 0, "paused": 0, "retracted": 0},
        },
        {"dp_rank": 2, "disaggregation": None},
    ],
}


def test_sglang_loads_sum_dp_ranks():
    values = parse_loads(SGLANG_LOADS, SGLANG)
    assert values == {
        "num_running": 0,
        "num_queue": 4,
        "kv_pages_total": 2000,
        "kv_pages_free": 1900,
        "prefill_inflight": 1,
        "bootstrap_queue": 2,
        "decode_prealloc": 0,
        "decode_transfer": 0,
    }


def test_sglang_live_loads_override_stale_gauges_counters_from_metrics():
    # /metrics says inflight 0 (written at the last batch); /v1/loads says 1 (live).
    s = build_sample(100.0, "prefill", SGLANG, metrics_text=SGLANG_METRICS, loads=SGLANG_LOADS)
    assert s.reachable and s.kind == SGLANG
    assert s.prefill_inflight == 1
    assert s.num_running == 0
    assert s.transfer_failed == 31 and s.transfers_completed == 40


def test_sglang_without_loads_endpoint_uses_gauges():
    s = build_sample(1.0, "prefill", SGLANG, metrics_text=SGLANG_METRICS, loads=None, error="/v1/loads: HTTP 404")
    assert s.reachable and s.prefill_inflight == 0 and s.bootstrap_queue == 3
    assert s.error == "/v1/loads: HTTP 404"


OWN_LOADS = {
    "role": "prefill",
    "queues": {"waiting": 2, "running": 1, "bootstrap": 0, "inflight": 3, "prealloc": 0, "transfer": 0},
    "prefill_inflight_oldest_age_seconds": 33.0,
    "kv_pages_free": 10,
    "kv_pages_total": 64,
    "counters": {
        "kv_transfers_completed_total": 5,
        "num_transfer_failed_reqs": 1,
        "scheduler_loop_iterations": 99,
        "generation_tokens": 7,
        "unknown": 1,
    },
}


def test_own_loads_parsed():
    values = parse_loads(OWN_LOADS, BUILTIN)
    assert values == {
        "num_queue": 2,
        "num_running": 1,
        "bootstrap_queue": 0,
        "prefill_inflight": 3,
        "decode_prealloc": 0,
        "decode_transfer": 0,
        "prefill_inflight_oldest_age_seconds": 33.0,
        "kv_pages_free": 10,
        "kv_pages_total": 64,
        "counter:transfers_completed": 5,
        "counter:transfer_failed": 1,
        "counter:loop_iterations": 99,
        "counter:generation_tokens": 7,
    }


def test_own_loads_tolerates_missing_and_wrong_types():
    assert parse_loads({}, BUILTIN) == {}
    assert parse_loads(None, BUILTIN) == {}
    assert parse_loads([1, 2], BUILTIN) == {}
    odd = {
        "queues": {"inflight": "3", "waiting": None, "running": True, "transfer": 2},
        "kv_pages_total": float("nan"),
        "counters": ["x"],
    }
    assert parse_loads(odd, BUILTIN) == {"decode_transfer": 2}


def test_loads_gauges_win_metrics_counters_win():
    s = build_sample(
        5.0, "prefill", BUILTIN, metrics_text=dsv4_metrics_text(inflight=9, age=1.0, completed=70), loads=OWN_LOADS
    )
    assert s.prefill_inflight == 3 and s.prefill_inflight_oldest_age_seconds == 33.0
    assert s.transfers_completed == 70  # /metrics counter, not the loads fallback
    assert s.loop_iterations == 12345


def test_loads_counters_fill_in_when_metrics_missing():
    s = build_sample(5.0, "prefill", BUILTIN, metrics_text=None, loads=OWN_LOADS, error="/metrics: timeout")
    assert s.reachable
    assert s.transfers_completed == 5 and s.loop_iterations == 99
    assert s.transfer_timeout is None


def test_no_source_is_unreachable():
    s = build_sample(5.0, "decode", BUILTIN, error="connect refused")
    assert not s.reachable and s.error == "connect refused"
    assert all(getattr(s, f) is None for f in GAUGE_FIELDS + COUNTER_FIELDS)


def test_sample_to_dict_is_plain():
    s = build_sample(5.0, "prefill", BUILTIN, metrics_text=dsv4_metrics_text(), loads=OWN_LOADS)
    d = s.to_dict()
    assert d["timestamp"] == 5.0 and d["role"] == "prefill" and d["reachable"] is True
    assert all(v is None or isinstance(v, (str, bool, float, int)) for v in d.values())
    assert not any(isinstance(v, float) and math.isnan(v) for v in d.values())
