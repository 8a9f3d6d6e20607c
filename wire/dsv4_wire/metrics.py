"""Engine metric names (prefix `dsv4:`, names follow SGLang's so dashboards translate 1:1).

Keys are the names without the prefix; counters are exposed with `_total` appended, histograms
with `_bucket`/`_sum`/`_count`. The engine registers them, the operator's watchdog and the
dashboards read them: both import them from here.
"""

PREFIX = "dsv4:"

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
    "prefix_cache_pages": "KV pages held by the prefix cache (the idle ones also count as free)",
    "prefix_cache_snapshots": "Slot-row snapshots held by the prefix cache (models with slot states: DeepSeek-V4)",
    "kv_pages_pinned": "Cached KV pages pinned by named sessions (evicted only when nothing else is left)",
    "sessions_active": "Named sessions (prompt_cache_key / x-session-id) whose TTL has not run out",
    "tp_size": "Ranks (devices) this engine runs on (--tp-size); rank 0 reports for all",
    "nnodes": "Hosts this engine spans (--nnodes); every node reports it",
}
# Served by the HTTP process itself (not the core's registry): what only it knows.
HTTP_GAUGES = {
    "num_http_waiting_reqs": "Requests the HTTP server holds with no output from the engine core yet "
    "(tokenising, on their way, or waiting there)",
}
# Served by the other nodes of a multi-node engine (their node agent's /metrics), with `nnodes`.
NODE_GAUGES = {
    "node_rank": "This node's place in its engine (--node-rank)",
    "node_group_ready": "1 once node 0 said every rank of the engine loaded (the group serves)",
    "node_ranks_running": "This node's rank processes still running",
    "node_rank_beat_age_seconds": "Age of the oldest heartbeat among this node's ranks (a stopped rank's grows)",
}
# Gauges with a `state` label besides role/model_name: one series per state the model declares
# (DeepSeek-V3: its one latent cache; V4: windowed and compressed states). Paged states cost
# bytes per token of context, slot states bytes per running request whatever its length.
STATE_GAUGES = {
    "kv_state_bytes_per_token": "Bytes one token of context costs in each paged state (all layers)",
    "kv_state_bytes_per_request": "Bytes one running request costs in each fixed-size (slot) state (all layers)",
    "prefix_cache_state_bytes": "Bytes the prefix cache holds now in each state (paged: cached pages; slot: snapshots)",
}
STATE_LABEL = "state"
# Series with a `tier` label (dsv4_wire.kv_events.TIERS: device, host, disk): one per cache tier.
TIER_GAUGES = {
    "prefix_cache_tier_pages": "KV pages the prefix cache holds in each tier",
}
TIER_COUNTERS = {
    "prefix_cache_tier_hit_tokens": "Tokens of admitted requests whose KV came from each tier of the prefix cache",
}
TIER_LABEL = "tier"
# Data-parallel attention (--dp-size N): one series per attention rank, labelled `dp_rank`. The
# waiting queue is the engine's (num_queue_reqs): a request takes its rank when it is admitted.
RANK_GAUGES = {
    "dp_rank_running_reqs": "--dp-size N: requests running on each attention rank",
    "dp_rank_kv_pages_used": "--dp-size N: KV pages of each rank's pool its running requests hold",
    "dp_rank_kv_pages_free": "--dp-size N: KV pages each rank can hand out (its idle cached pages included)",
    "dp_rank_prefix_cache_pages": "--dp-size N: KV pages each rank's prefix cache holds",
}
RANK_COUNTERS = {
    "dp_rank_prefix_cache_hit_tokens": "--dp-size N: tokens of admitted requests whose KV each rank's prefix cache "
    "supplied",
}
RANK_LABEL = "dp_rank"
# MoE expert loads (EPLB, docs/eplb.md), read from the engine's counters at scrape time. Labelled
# by `layer` (the decoder layer's index); the per-expert counter also by `expert` (the logical
# expert id): layers x experts series, so it is served only while that is at most
# EXPERT_SERIES_MAX (the tiny presets; DeepSeek-V3's 58 x 256 is not) -- the full table is always
# in `GET /admin/expert_loads` and /v1/loads `expert_loads`.
LAYER_GAUGES = {
    "moe_expert_load_imbalance": "Max over mean of the tokens routed to each logical expert of a MoE layer, since start",
    "moe_rank_load_imbalance": "Max over mean of the expert tokens each rank computed for a MoE layer, since start "
    "(with --ep-redundant-experts: after spreading over the copies)",
}
LAYER_COUNTERS = {
    "moe_layer_routed_tokens": "Token-to-expert choices (tokens x top-k) made by a MoE layer",
}
EXPERT_COUNTERS = {
    "moe_expert_tokens": "Tokens routed to each logical expert of a MoE layer (served while layers x experts "
    "<= 4096; else see GET /admin/expert_loads)",
}
LAYER_LABEL = "layer"
EXPERT_LABEL = "expert"
EXPERT_SERIES_MAX = 4096
COUNTERS = {
    "num_bootstrap_failed_reqs": "Requests failed during the PD bootstrap",
    "num_transfer_failed_reqs": "Requests whose KV transfer failed",
    "num_transfer_timeout_reqs": "Requests whose KV transfer hit its deadline",
    "kv_transfers_completed": "KV transfers completed",
    "kv_transfer_bytes": "Bytes of KV moved between engines",
    "kv_transfer_checksum_failed": "Requests whose KV landed with other bytes than were sent (--transfer-checksum)",
    "prompt_tokens": "Prompt tokens processed",
    "generation_tokens": "Tokens generated",
    "num_aborted_reqs": "Requests aborted (client gone, admin, peer)",
    "native_build_failures": "Native CPU kernels whose build failed at start-up (their ops run the torch "
    "reference; /v1/loads `kernels` says why)",
    "num_decode_local_reqs": "PD requests decode served from its own prefix cache (--decode-local-prefill): "
    "nothing prefilled on prefill, nothing transferred",
    "num_queue_full_reqs": "Requests refused at admission with a 429: --max-queued-requests were waiting",
    "scheduler_loop_iterations": "Iterations of the scheduler loop",
    "prefix_cache_query_tokens": "Tokens of admitted requests looked up in the prefix cache",
    "prefix_cache_hit_tokens": "Tokens of admitted requests whose KV the prefix cache supplied",
    "spec_decode_num_draft_tokens": "Speculative decoding: drafted tokens verified by the target",
    "spec_decode_num_accepted_tokens": "Speculative decoding: drafted tokens the target accepted",
    "spec_decode_num_verify_steps": "Speculative decoding: verify steps of requests that had drafts",
}
HISTOGRAMS = {
    "time_to_first_token_seconds": "Time to first token",
    "inter_token_latency_seconds": "Time between tokens of one request",
    "e2e_request_latency_seconds": "Arrival to finish",
    "kv_transfer_latency_seconds": "KV transfer start to completion",
}
# Histograms of counts, not seconds: their own buckets.
COUNT_HISTOGRAMS = {
    "spec_decode_accept_length": "Speculative decoding: tokens one verify step emitted (accepted drafts + 1)",
}
COUNT_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 9)


def metric_name(key: str, suffix: str = "") -> str:
    """The exposed name of a metric key: metric_name("kv_transfers_completed", "_total")."""
    if (
        key not in GAUGES
        and key not in NODE_GAUGES
        and key not in HTTP_GAUGES
        and key not in STATE_GAUGES
        and key not in COUNTERS
        and key not in HISTOGRAMS
        and key not in COUNT_HISTOGRAMS
        and key not in TIER_GAUGES
        and key not in TIER_COUNTERS
        and key not in RANK_GAUGES
        and key not in RANK_COUNTERS
        and key not in LAYER_GAUGES
        and key not in LAYER_COUNTERS
        and key not in EXPERT_COUNTERS
    ):
        raise KeyError(f"no dsv4 metric {key!r}")
    return f"{PREFIX}{key}{suffix}"
