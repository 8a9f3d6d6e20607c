"""Every option of `dsv4 serve`, declared once (dsv4_wire.options).

The command line is a wire format: the operator's manifests and `dsv4 up` write it, the engine
parses it. So the one declaration lives here, at the bottom of the house, and everything else is
made from it: `dsv4_engine.engine_args.EngineArgs` (scope "engine") and
`dsv4_serve.server_args.ServerArgs` (scopes "engine" + "server"), the `dsv4 serve` command's
parameters (dsv4_cli.options), the flag names `EngineFlags` spells, and the PD deadlines'
defaults (`PDSettings`, `dsv4 up`).
"""

from __future__ import annotations

from typing import Any, Mapping

from dsv4_wire.auth import ADMIN_TOKEN_ENV, PD_SECRET_ENV
from dsv4_wire.options import REQUIRED, Option, in_scopes, secret

_O = Option  # short: the tables below are read as tables
SERVE_OPTIONS: tuple[Option, ...] = (
    # ---- what the engine is built from (EngineArgs) ----
    _O("model", str, REQUIRED, "Checkpoint folder (from `dsv4 model init` or save_pretrained)."),
    _O("role", str, "mono", "mono | prefill | decode", choices=("mono", "prefill", "decode")),
    _O(
        "dtype",
        str,
        None,
        "float32 | bfloat16 (default: bfloat16 on CUDA, float32 on CPU).",
        choices=("float32", "bfloat16"),
    ),
    _O("served_model_name", str, None, "Name in /v1/models (default: the checkpoint folder's name)."),
    _O("kv_pages", int, None, "KV pool size in pages (default: from the device's memory, or --kv-memory-gb)."),
    _O(
        "kv_memory_gb",
        float,
        None,
        "KV pool size in GiB, overriding --kv-memory-fraction (default: from the device's free memory on CUDA, "
        "1 GiB on CPU).",
    ),
    _O(
        "kv_memory_fraction",
        float,
        0.9,
        "CUDA: the KV pool takes this share of the memory free once the weights are loaded, less a reserve for "
        "the decode CUDA graphs, on the tightest rank (as SGLang's --mem-fraction-static / vLLM's "
        "--gpu-memory-utilization; prefix-cache snapshots take at most a quarter of it by default).",
    ),
    _O(
        "page_size",
        int,
        None,
        "Tokens per KV page (default: 16, or the model's longest compression window when "
        "longer, e.g. 128 for DeepSeek-V4-Flash, so compressed states fill their pages).",
    ),
    _O(
        "kv_cache_dtype",
        str,
        "auto",
        "auto | fp8_e4m3 (fp8 is e4m3, as vLLM's): store the attention KV (V3's latent, V4's compressed "
        "entries, indexer keys and window) in FP8 with a float32 scale per entry, about half the bytes per "
        "token of bf16; auto: the model's dtype. PD peers must agree.",
        choices=("auto", "fp8_e4m3", "fp8"),
    ),
    _O("max_num_seqs", int, 64, "Most requests running at once."),
    _O(
        "max_queued_requests",
        int,
        None,
        "Most requests waiting to run (SGLang's flag): the waiting queue, plus PD's bootstrap and "
        "prealloc queues. One more is refused at admission, before any PD state is made, with a "
        "429 and Retry-After. Default: no bound.",
        min=1,
    ),
    _O("max_num_batched_tokens", int, 1024, "Token budget of one step (chunked prefill)."),
    _O("max_model_len", int, None, "Context limit (default: the model's)."),
    _O(
        "grammar_compile_timeout",
        float,
        10.0,
        "Seconds a structured-output grammar may take to compile (on a thread of its own) before "
        "its request is refused with a 400.",
        min=0.1,
    ),
    _O(
        "kernel_backend",
        str,
        None,
        "cpu | torch | triton: the kernels every op runs (default: triton on CUDA, else cpu, the C "
        "kernels where they apply and the torch reference where not; torch: the reference alone).",
        choices=("cpu", "torch", "triton"),
    ),
    _O("device", str, None, "cpu | cuda | cuda:N (default: cuda when present)."),
    _O("seed", int, 0, "Default sampling seed."),
    _O(
        "enable_prefix_cache",
        bool,
        True,
        "Turn prefix caching off (on by default: a request reuses the KV pages "
        "of the longest cached prefix and, for DeepSeek-V4, a snapshot of its window/compressor state at a "
        "boundary; decode engines never reuse).",
        flag="--disable-prefix-cache",
    ),
    _O(
        "prefix_cache_snapshots",
        int,
        None,
        "DeepSeek-V4: slot-row snapshots the prefix cache keeps, each one slot "
        "row of memory taken from the KV pool (default: 4 x --max-num-seqs, at most a quarter of the pool; 0 turns "
        "V4 prefix reuse off).",
        min=0,
    ),
    _O(
        "host_cache_gb",
        float,
        0.0,
        "Host-memory tier under the device KV pool, in GiB (0: off): pages the pool evicts go there and "
        "come back on a prefix hit instead of being recomputed (pinned memory on CUDA).",
        min=0,
    ),
    _O(
        "disk_cache_dir",
        str,
        None,
        "Disk tier under the host tier: pages (and V4 snapshots) the host tier drops go to files here and come "
        "back on a prefix hit (needs --host-cache-gb and --disk-cache-gb; emptied at start; refused when a "
        "symlink, not ours or world-writable).",
    ),
    _O(
        "disk_cache_gb",
        float,
        0.0,
        "Bound of the disk tier in GiB (with --disk-cache-dir); its least recently used files go first.",
        min=0,
    ),
    _O(
        "session_ttl",
        float,
        30.0,
        "Seconds a named conversation's cached prefix (prompt_cache_key or x-session-id) stays "
        "pinned after each round (more than 0, at most 3600).",
    ),
    _O(
        "session_pin_share",
        float,
        0.5,
        "Most of the KV pool one tenant's sessions may pin, as a fraction (0 to 1); pins past it are plain LRU.",
        min=0,
    ),
    _O(
        "prefix_cache_snapshot_interval",
        int,
        None,
        "DeepSeek-V4: tokens between the snapshots a prefill chunk "
        "leaves behind, besides its prompt's branch point and last boundary (default: 8 boundaries; 0: none; torch "
        "path only).",
        min=0,
    ),
    _O(
        "decode_local_prefill",
        int,
        2048,
        "PD decode: keep a prefix cache of finished requests (prompt + answer) and serve a request "
        "itself, with neither prefill nor KV transfer, when that cache holds all of it but at most N tokens "
        "(the next round of a conversation: the new turn, a tool result); 0 = off (decode keeps no cache and "
        "receives every page from prefill). docs/prefix-caching.md, PD.",
        min=0,
    ),
    _O(
        "cuda_graph_max_bs",
        int,
        None,
        "Decode batches up to N requests replay captured CUDA graphs (CUDA + triton kernels; 0 = off; default: "
        "min(--max-num-seqs, 64) where graphs are supported; a failed capture falls back to eager, logged and in "
        "/v1/loads).",
        min=0,
    ),
    _O(
        "tp_size",
        int,
        1,
        "Ranks (GPUs) one engine spans: attention heads and MLPs split, experts spread (NCCL on "
        "CUDA, gloo on CPU); this process is rank 0.",
        min=1,
    ),
    _O(
        "dp_size",
        int,
        1,
        "Data-parallel attention (SGLang's --enable-dp-attention), equal to --tp-size: each rank attends over its "
        "own requests and holds only their KV pages; the MoE runs expert-parallel over every rank's tokens. "
        "DeepSeek-V3 only, not yet with PD, MTP or CUDA graphs; a prefix cache per rank (docs/tensor-parallel.md).",
        min=1,
    ),
    _O(
        "nnodes",
        int,
        1,
        "Hosts one engine spans (SGLang's flag): --tp-size is the whole engine's, each node runs --tp-size / "
        "--nnodes ranks. Node 0 serves HTTP and PD; the others run ranks only.",
        min=1,
    ),
    _O("node_rank", int, 0, "This host's place among --nnodes (0: the node that serves).", min=0),
    _O(
        "ep_redundant_experts",
        int,
        0,
        "EPLB: R extra copies of the hottest routed experts (DeepSeek-V3-style MoE, unquantized), at most one per "
        "rank (R <= --tp-size), placed by load over the ranks; tokens of a replicated expert spread over its "
        "copies. Placed from --ep-loads-file, else evenly until POST /admin/eplb/rebalance (docs/eplb.md).",
        min=0,
    ),
    _O(
        "ep_loads_file",
        str,
        None,
        "EPLB: expert loads recorded from a run (the JSON of GET /admin/expert_loads) to place the "
        "--ep-redundant-experts copies from at start.",
    ),
    _O(
        "dist_init_addr",
        str,
        None,
        "Node 0's HOST:PORT, the same on every node: torch.distributed's rendezvous there, the node channel on "
        "PORT+1 (needed with --nnodes > 1).",
    ),
    _O(
        "speculative_algorithm",
        str,
        None,
        "Speculative decoding with the checkpoint's own MTP layer: mtp (aliases "
        "EAGLE, NEXTN, deepseek_mtp). Off by default; DeepSeek-V3 and -V4 checkpoints with an MTP layer (mono, "
        "or prefill and decode both with it), any --tp-size (the MTP block splits like a layer).",
    ),
    _O("speculative_num_steps", int, 1, "Tokens drafted per step with --speculative-algorithm.", min=1),
    # ---- the HTTP server and PD (ServerArgs) ----
    _O(
        "chat_answer_memo",
        int,
        4096,
        "Chat: answers this engine generated, remembered by their text (per cache salt) so a re-sent "
        "answer renders with its generated ids and the next round finds its KV; 0 = off (re-sent answers are "
        "tokenized again). docs/prefix-caching.md, Chat.",
        min=0,
        scope="server",
    ),
    _O("host", str, "127.0.0.1", "Address to listen on.", scope="server"),
    _O("port", int, 8100, "Port of the OpenAI API.", scope="server"),
    _O(
        "advertise_host",
        str,
        None,
        "PD: the address peers reach this engine at (decode tells prefill where to send "
        "aborts). Default: --host, unless it is 0.0.0.0 or ::, then $POD_IP, then 127.0.0.1.",
        scope="server",
    ),
    _O(
        "bootstrap_port",
        int,
        None,
        "Prefill: port of the bootstrap endpoint (default: --port + 1000).",
        scope="server",
    ),
    _O("bootstrap_timeout", float, 30.0, "Seconds a PD request may wait for its peer.", scope="server"),
    _O("transfer_timeout", float, 30.0, "Seconds a KV transfer may take.", scope="server"),
    _O("waiting_timeout", float, 60.0, "Seconds decode waits for the KV of a request.", scope="server"),
    _O(
        "deadlines",
        bool,
        True,
        "Disable PD deadlines (reproduces the wedge; tests only).",
        scope="server",
        flag="--no-deadlines",
    ),
    _O("enable_fault_injection", bool, False, "Expose POST /admin/faults.", scope="server"),
    _O(
        "arm_faults",
        str,
        (),
        "Arm a fault at start: NAME[:key=value,...], e.g. stall_long_context:tokens=300 "
        "(repeatable; needs --enable-fault-injection and a prefill or decode role; count defaults to -1, until "
        "cleared).",
        scope="server",
        flag="--arm-fault",
        repeat=True,
    ),
    *secret(
        "admin_token",
        "Token required by /admin, /debug and /v1/loads (prefer --admin-token-file: argv is visible to every user).",
        "server",
        ADMIN_TOKEN_ENV,
    ),
    *secret(
        "pd_secret",
        "Shared secret of engine-to-engine PD calls and the router's internal requests "
        "(prefer --pd-secret-file). Required by prefill/decode engines on a non-loopback address.",
        "server",
        PD_SECRET_ENV,
    ),
    _O(
        "max_request_bytes",
        int,
        16 * 1024 * 1024,
        "Largest request body accepted (bigger: 413).",
        scope="server",
        min=1,
    ),
    _O(
        "client_timeout",
        float,
        30.0,
        "Seconds a client has to send a request's headers, and then its body (slower: cut off, 408).",
        scope="server",
        min=0.1,
    ),
    _O(
        "max_connections",
        int,
        4096,
        "Connections and requests served at once (more: 503).",
        scope="server",
        min=1,
    ),
    _O(
        "shutdown_grace",
        float,
        30.0,
        "On SIGTERM: seconds running requests get to finish before they are ended "
        "with an error (Kubernetes' default termination grace).",
        scope="server",
        min=0.0,
    ),
    _O(
        "transfer_checksum",
        bool,
        False,
        "PD: checksum every KV/state region of a hand-off; decode verifies what "
        "landed and fails the request on a mismatch.",
        scope="server",
    ),
    _O(
        "chat_template",
        str,
        None,
        "A Jinja chat template file used instead of the checkpoint's chat format (as vLLM's flag).",
        scope="server",
    ),
    _O(
        "tool_call_parser",
        str,
        None,
        "How tool calls are read from the model's output: deepseek_v3, deepseek_v31, "
        "deepseek_v32, deepseek_v4 (SGLang's deepseekv31 etc. too; default: the checkpoint's format).",
        scope="server",
    ),
    _O(
        "disable_auto_tool_grammar",
        bool,
        False,
        'Leave `tool_choice: "auto"` unconstrained (the raw model). By default a request with '
        "tools and `auto` is free text until the format's tool-call marker, then held to a "
        "well-formed call block of the given tools.",
        scope="server",
    ),
    _O(
        "reasoning_parser",
        str,
        None,
        "How reasoning is split from the answer: deepseek-r1, deepseek-v3, "
        "deepseek-v4 (default: the checkpoint's format).",
        scope="server",
    ),
    _O(
        "otlp_traces_endpoint",
        str,
        None,
        "Export OpenTelemetry traces (OTLP/HTTP) to this URL, e.g. http://collector:4318 (off by default).",
        scope="server",
    ),
    _O(
        "api_keys",
        list,
        (),
        "Client API keys required on /v1/* (dsv4_wire.api_keys.ApiKey), from --api-key and --api-key-file.",
        scope="server",
        cli=False,
    ),
    _O(
        "api_key",
        str,
        (),
        "Client API key required on /v1/* as `Authorization: Bearer` (repeat for more; vLLM's "
        "flag). Prefer --api-key-file.",
        scope="command",
        repeat=True,
    ),
    _O(
        "api_key_file",
        str,
        (),
        "File of API keys, one a line (`KEY` or `NAME KEY`, NAME shown in metrics).",
        scope="command",
        repeat=True,
    ),
)
del _O

OPTIONS_BY_NAME: Mapping[str, Option] = {o.name: o for o in SERVE_OPTIONS}
PD_DEADLINES = ("bootstrap_timeout", "transfer_timeout", "waiting_timeout")
SERVE_SCOPES = ("engine", "server", "command")  # every option of `dsv4 serve`


def options(*scopes: str) -> list[Option]:
    return in_scopes(SERVE_OPTIONS, *scopes)


def default(name: str) -> Any:
    """The declared default of one option (the PD deadlines' for PDSettings and `dsv4 up`)."""
    return OPTIONS_BY_NAME[name].default
