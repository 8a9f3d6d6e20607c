"""The engine's Prometheus metrics (names follow SGLang's, prefix `dsv4:`), on a registry of
its own so several engines can live in one process (tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

GAUGES = {
    "num_running_reqs": "Requests running in the batch",
    "num_queue_reqs": "Requests waiting to be scheduled",
    "num_prefill_bootstrap_queue_reqs": "Prefill: requests waiting for their decode peer",
    "num_prefill_inflight_queue_reqs": "Prefill: requests whose KV is being sent to decode",
    "num_decode_prealloc_queue_reqs": "Decode: requests waiting for pages / the prefill handshake",
    "num_decode_transfer_queue_reqs": "Decode: requests waiting for their KV to arrive",
    "prefill_inflight_oldest_age_seconds": "Age of the oldest request in the prefill inflight queue",
    "kv_pages_free": "Free KV cache pages",
    "kv_pages_total": "Total KV cache pages",
}
COUNTERS = {
    "num_bootstrap_failed_reqs": "Requests failed during the PD bootstrap",
    "num_transfer_failed_reqs": "Requests whose KV transfer failed",
    "num_transfer_timeout_reqs": "Requests whose KV transfer hit its deadline",
    "kv_transfers_completed": "KV transfers completed",
    "kv_transfer_bytes": "Bytes of KV moved between engines",
    "prompt_tokens": "Prompt tokens processed",
    "generation_tokens": "Tokens generated",
    "num_aborted_reqs": "Requests aborted (client gone, admin, peer)",
    "scheduler_loop_iterations": "Iterations of the scheduler loop",
}
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
HISTOGRAMS = {
    "time_to_first_token_seconds": "Time to first token",
    "inter_token_latency_seconds": "Time between tokens of one request",
    "e2e_request_latency_seconds": "Arrival to finish",
    "kv_transfer_latency_seconds": "KV transfer start to completion",
}


class EngineMetrics:
    def __init__(self, role: str, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["role", "model_name"]
        self.labels = {"role": role, "model_name": model_name}
        self.gauges = {k: Gauge(f"dsv4:{k}", d, labels, registry=self.registry).labels(**self.labels) for k, d in GAUGES.items()}
        self.counters = {k: Counter(f"dsv4:{k}", d, labels, registry=self.registry).labels(**self.labels) for k, d in COUNTERS.items()}
        self.histograms = {
            k: Histogram(f"dsv4:{k}", d, labels, buckets=LATENCY_BUCKETS, registry=self.registry).labels(**self.labels)
            for k, d in HISTOGRAMS.items()
        }
        # Plain mirrors of the counters so /v1/loads can report them without parsing.
        self.totals = {k: 0.0 for k in COUNTERS}

    def inc(self, name: str, amount: float = 1.0) -> None:
        self.counters[name].inc(amount)
        self.totals[name] += amount

    def set(self, name: str, value: float) -> None:
        self.gauges[name].set(value)

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
