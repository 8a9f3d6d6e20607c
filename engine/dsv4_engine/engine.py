"""The engine loop: one thread owns the model, the KV pool and every queue.

Other threads talk to it only through `submit`, `abort` and `call` (an inbox of typed
commands), and hear back through each request's sink, so no lock guards the scheduler state.
The loop also keeps the live gauges current while idle: a stuck request must be visible without
traffic.

Failure isolation: whatever goes wrong for one request (adding it, sampling its row, detokenising
or stop handling) ends that request alone with an error; only a failed forward pass fails the
requests of that batch, and nothing ends the loop.
"""

from __future__ import annotations

from dsv4_wire import switches

import logging
import os
import queue
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch

from dsv4_engine.cuda_graphs import resolve_graph_max_bs
from dsv4_engine.device_errors import device_failure
from dsv4_engine.devices import use_device
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.kv_cache import (
    KVPool,
    SnapshotPool,
    check_page_size,
    default_page_size,
    page_nbytes,
    snapshot_boundary,
)
from dsv4_engine.kv_quant import pool_kv_dtype
from dsv4_engine.kv_sizing import (
    KVBudget,
    PoolSize,
    device_memory,
    graph_reserve_bytes,
    kv_budget,
    size_pool,
)
from dsv4_engine.start_fit import memory_refusal
from dsv4_engine.metrics import EngineMetrics
from dsv4_engine.model_runner import ModelRunner, default_device
from dsv4_engine.models.state import StateSpec
from dsv4_engine.prefix_cache import PrefixCache
from dsv4_engine.disk_tier import DiskTier, disk_tier_refusal
from dsv4_engine.host_tier import build_host_tier, host_tier_refusal
from dsv4_engine.session_pins import SessionPins, session_refusal
from dsv4_engine.sampling import SamplingError, request_generator, skip_draw
from dsv4_engine.scheduler import Scheduler
from dsv4_engine.sequence import Sequence, SeqStatus
from dsv4_engine.step_clock import StepClock
from dsv4_engine.step_tally import StepTally
from dsv4_engine.request_output import RequestOutput
from dsv4_engine.step_phases import PHASES
from dsv4_engine.tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:
    from dsv4_engine.pd.role import RoleController

log = logging.getLogger("dsv4.engine")
QUEUE_FULL = "the engine's queue is full"  # the start of a --max-queued-requests refusal

DEVICE_FAIL_GRACE_S = 1.0  # after a device failure: time for the failed requests' outputs to leave


@dataclass(frozen=True)
class AddRequest:
    seq: Sequence


@dataclass(frozen=True)
class AbortRequest:
    rid: Optional[str]
    reason: str = "aborted"
    all: bool = False
    seq: Optional[Sequence] = None  # when set, abort only this very request (rids come from clients)


@dataclass(frozen=True)
class Call:
    """Run fn() on the engine thread (role controllers and admin actions)."""

    fn: Callable[[], None]


Command = Union[AddRequest, AbortRequest, Call]


def state_refusal(specs: list[StateSpec], role: str, page_size: Optional[int]) -> Optional[str]:
    """Why an engine of this role and page size (None: not checked) cannot hold the model's
    states, in one line, or None. Every role takes every model: PD moves slot states too."""
    if page_size is not None:
        try:
            check_page_size(specs, page_size)
        except ValueError as e:
            return f"--page-size {page_size} does not fit this model: {e}"
    return None


def args_refusal(args: EngineArgs) -> Optional[str]:
    """Why an engine cannot be built from these flags alone (no checkpoint read), in one line,
    or None: limits that serve nothing, a kernel backend this device cannot run."""
    from dsv4_engine.parallel.layout import layout_refusal

    from dsv4_engine.kv_sizing import fraction_refusal
    from dsv4_engine.parallel.eplb import ep_flags_refusal

    return (
        limits_refusal(args.max_num_seqs, args.max_num_batched_tokens)
        or fraction_refusal(args.kv_memory_fraction)
        or backend_refusal(args.kernel_backend, args.device)
        or layout_refusal(args.tp_size, args.nnodes, args.node_rank, args.dist_init_addr)
        or node_role_refusal(args)
        or session_refusal(args.session_ttl, args.session_pin_share)
        or ep_flags_refusal(
            args.ep_redundant_experts, args.ep_loads_file, args.tp_size, args.speculative_algorithm is not None
        )
    )


def node_role_refusal(args: EngineArgs) -> Optional[str]:
    """An engine object is node 0's: the other nodes of a multi-node engine run ranks only
    (dsv4_engine.parallel.node_agent)."""
    if args.node_rank != 0:
        return f"--node-rank {args.node_rank} runs ranks only (the node agent), not an engine"
    return None


def limits_refusal(max_num_seqs: int, max_num_batched_tokens: int) -> Optional[str]:
    """Why these scheduler limits cannot serve anything, in one line, or None: a step budget of
    0 tokens never admits a request (it waits forever), and 0 requests at once leaves a model
    with slot states no row to give."""
    for flag, value in (("--max-num-seqs", max_num_seqs), ("--max-num-batched-tokens", max_num_batched_tokens)):
        if value < 1:
            return f"{flag} must be at least 1, not {value}"
    return None


def backend_refusal(kernel_backend: Optional[str], device: Optional[str]) -> Optional[str]:
    """Why --kernel-backend cannot run on this device, in one line, or None: Triton kernels need
    a CUDA device, or its CPU interpreter (TRITON_INTERPRET=1, slow: for tests). Without this,
    such an engine started and then failed every request."""
    import os

    if kernel_backend != "triton":
        return None
    dev = torch.device(device) if device else default_device()
    if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return (
            f"--kernel-backend triton needs a CUDA device, not {dev.type} (or TRITON_INTERPRET=1 for "
            f"Triton's slow CPU interpreter); use --kernel-backend cpu on a CPU"
        )
    return None


def dp_refusal_for(args: EngineArgs) -> Optional[str]:
    """--dp-size's refusal (dsv4_engine.parallel.dp_attention) for these flags and checkpoint."""
    if args.dp_size <= 1:
        return None
    from dsv4_engine.models import entry_for_dir
    from dsv4_engine.parallel.dp_attention import dp_refusal

    return dp_refusal(args, entry_for_dir(args.model).model_type)


def serving_refusal(model_dir: str, role: str, page_size: Optional[int], tp_size: int = 1) -> Optional[str]:
    """`state_refusal` (and the --tp-size checks) for a checkpoint folder, before any weight is
    read (for the CLI, and before an engine spawns its other ranks)."""
    from dsv4_engine.models import entry_for_dir
    from dsv4_engine.parallel.plan import tp_refusal

    entry = entry_for_dir(model_dir)
    cfg = entry.config_class().from_dir(model_dir)
    return tp_refusal(entry.model_type, cfg, tp_size) or state_refusal(
        entry.model_class().state_specs(cfg), role, page_size
    )


def prefix_cache_refusal(
    specs: list[StateSpec], role: str, enabled: bool = True, snapshots: Optional[int] = None, decode_local: int = 0
) -> Optional[str]:
    """Why this engine runs without a prefix cache, in one line, or None when it has one."""
    if not enabled:
        return "turned off (--disable-prefix-cache)"
    if role == "decode" and not decode_local:
        return (
            "a decode engine receives every page of a request from prefill; it has nothing to reuse "
            "(--decode-local-prefill N gives it a cache of finished conversations)"
        )
    slot_states = [s.name for s in specs if not s.paged]
    if slot_states and snapshots == 0:
        return "--prefix-cache-snapshots 0: no snapshot of the slot state to resume a prefix from"
    return None


# Snapshots inside a prefill chunk (the torch path writes them for free): every this many
# boundaries, besides a prompt's branch point and last boundary. Each costs a slot row, ~10x the
# paged state of one boundary (docs/prefix-caching.md), so not every boundary.
DEFAULT_SNAPSHOT_BOUNDARIES = 8


def default_snapshots(max_num_seqs: int) -> int:
    """Snapshots the prefix cache of a model with slot states keeps when not told: four per
    running request. Each conversation needs its latest one to survive until its next round,
    while the others' prompts take theirs; at two per request, 16 conversations on 16 rows
    lost their fourth round's (bench prefix, v4-tiny)."""
    return 4 * max_num_seqs


class Engine:
    def __init__(self, args: EngineArgs):
        refusal = args_refusal(args)
        if refusal:  # before any weight is read or rank spawned
            raise ValueError(refusal)
        refusal = memory_refusal(args)  # a checkpoint that cannot fit the device: before it is read
        if refusal:
            raise ValueError(f"{args.model}: {refusal}")
        self.args = args
        self.tp = None  # rank 0's handle on the other ranks when tp_size > 1
        graph_max_bs = resolve_graph_max_bs(args.cuda_graph_max_bs, args.max_num_seqs)
        if args.tp_size > 1:
            from dsv4_engine.parallel.group import TPGroup, rank_device
            from dsv4_engine.parallel.layout import NodeLayout

            refusal = serving_refusal(args.model, args.role, args.page_size, args.tp_size)
            if refusal:  # before any rank is spawned
                raise ValueError(refusal)
            refusal = dp_refusal_for(args)
            if refusal:
                raise ValueError(refusal)
            layout = NodeLayout(args.tp_size, args.nnodes, args.node_rank, args.dist_init_addr)
            self.tp = TPGroup(args.tp_size, asdict(args), args.device, layout)
            self.tp.rank.data_parallel = args.dp_size > 1
            self.runner = ModelRunner(
                args.model,
                args.dtype,
                rank_device(args.device, 0),
                args.kernel_backend,
                graph_max_bs,
                tp=self.tp.rank,
                kv_cache_dtype=args.kv_cache_dtype,
                ep_redundant_experts=args.ep_redundant_experts,
                ep_loads_file=args.ep_loads_file,
            )
        else:
            if args.dp_size > 1:
                raise ValueError(f"--dp-size {args.dp_size} needs --tp-size {args.dp_size}")
            self.runner = ModelRunner(
                args.model,
                args.dtype,
                args.device,
                args.kernel_backend,
                graph_max_bs,
                kv_cache_dtype=args.kv_cache_dtype,
                ep_redundant_experts=args.ep_redundant_experts,
                ep_loads_file=args.ep_loads_file,
            )
        self.cfg = self.runner.cfg
        self.tokenizer = Tokenizer.from_dir(args.model)
        specs = self.runner.state_specs
        self.spec = None  # the MTP speculator when --speculative-algorithm is set (dsv4_engine.spec_decode)
        if args.speculative_algorithm is not None:
            from dsv4_engine.spec_decode.build import build_speculator

            self.spec = build_speculator(args, self.runner)  # ValueError: one line, as other refusals
            specs = specs + self.spec.state_specs
        page_size = args.page_size or default_page_size(specs)
        refusal = state_refusal(specs, args.role, page_size)
        if refusal:
            raise ValueError(refusal)
        self.prefix_cache_off = prefix_cache_refusal(
            specs, args.role, args.enable_prefix_cache, args.prefix_cache_snapshots, args.decode_local_prefill
        )
        if args.dp_size > 1 and self.prefix_cache_off is None:
            from dsv4_engine.parallel.dp_cache import dp_cache_refusal

            self.prefix_cache_off = dp_cache_refusal(specs, args.role)
        # Slot rows for max_num_seqs requests (and the cache's snapshots of them) come first; the
        # rest of the memory becomes pages (dsv4_engine.kv_sizing).
        cache_slots = any(not s.paged for s in specs) and self.prefix_cache_off is None
        # --dp-size N: each rank's pool holds the slot rows of its own share of the requests only
        slot_rows = args.max_num_seqs
        if self.tp is not None and args.dp_size > 1:
            from dsv4_engine.parallel.dp_pages import slot_rows_per_rank

            slot_rows = slot_rows_per_rank(args.max_num_seqs, args.dp_size)
        snapshots = args.prefix_cache_snapshots if cache_slots else 0
        memory = device_memory(self.runner.device)  # after this rank's weights
        if self.tp is not None:  # and the other ranks': the tightest one sizes every rank's pool
            memory = self.tp.tightest_memory(memory)
        if args.kv_pages:
            n = snapshots if snapshots is not None else default_snapshots(args.max_num_seqs)
            self.pool_size = PoolSize(args.kv_pages, n, KVBudget(0, f"--kv-pages {args.kv_pages}"))
        else:
            reserve = graph_reserve_bytes(self.runner.cuda_graph_max_bs, self.cfg.vocab_size, self.spec is not None)
            budget = kv_budget(args.kv_memory_gb, args.kv_memory_fraction, memory, reserve)
            default = default_snapshots(args.max_num_seqs) if cache_slots else 0
            self.pool_size = size_pool(specs, page_size, self.runner.dtype, budget, slot_rows, snapshots, default)
        num_pages, num_snapshots = self.pool_size.num_pages, self.pool_size.num_snapshots
        if cache_slots and num_snapshots == 0 and self.prefix_cache_off is None:
            self.prefix_cache_off = "no room for a slot-row snapshot in a quarter of the KV pool"
        self.kv_cache_dtype = pool_kv_dtype(specs)
        log.info(
            "KV pool: %d pages of %d tokens, %d slot rows, %d prefix-cache snapshots (%s); KV %s, %.0f bytes/token",
            num_pages,
            page_size,
            slot_rows,
            num_snapshots,
            self.pool_size.budget.source,
            self.kv_cache_dtype,
            page_nbytes(specs, page_size, self.runner.dtype) / page_size,
        )
        self.pool = KVPool(specs, num_pages, page_size, self.runner.dtype, self.runner.device, slot_rows)
        if self.runner.device.type == "cpu":  # every step streams the weights: 2 MB pages
            from dsv4_engine.parallel.sharded import model_tensors
            from dsv4_kernels import huge_pages

            huge_pages.advise_all(model_tensors(self.runner.model))
        if self.tp is not None and args.dp_size > 1:  # each rank a pool of its own requests' pages
            from dsv4_engine.parallel.dp_attention import DPForward
            from dsv4_engine.parallel.dp_pages import DPPageAllocator, DPSlotAllocator

            self.tp.announce_pool(num_pages, page_size, slot_rows, num_snapshots)
            self.pool.allocator = DPPageAllocator(args.dp_size, num_pages)
            if self.pool.slots is not None:  # rank r's rows: ids r*slot_rows.. (a row on its pages' rank)
                self.pool.slots = DPSlotAllocator(args.dp_size, slot_rows, num_pages)
                self.pool.allocator.slots = self.pool.slots
            self.runner.model = DPForward(self.runner.model, self.tp, num_pages, page_size, self.pool.num_slots)
            if self.spec is not None:  # its target and MTP forwards run data-parallel too
                from dsv4_engine.parallel.dp_spec import dp_speculator

                dp_speculator(self.spec, self.tp, num_pages, page_size, self.pool.slot_states)
            self.tp.on_failure.append(lambda reason: self.abort(reason=reason, all_=True))
            if self.runner.cuda_graph_max_bs and self.spec is None:  # each rank its own steps (parallel.dp_graphs)
                from dsv4_engine.parallel.dp_graphs import RankZeroDPGraphs, dp_decode_graphs, dp_graphs_refusal

                why = dp_graphs_refusal(self.runner.model_type)
                if why is not None:
                    log.info("CUDA graphs off: %s", why)
                    self.runner.drop_graphs(why)
                else:
                    graphs = dp_decode_graphs(self.runner, self.pool)
                    self.runner.graphs = RankZeroDPGraphs(graphs, self.tp, num_pages, self.pool.num_slots)
        elif self.tp is not None:  # the other ranks mirror the pool; each step reaches them first
            from dsv4_engine.parallel.group import BroadcastForward

            self.tp.announce_pool(num_pages, page_size, args.max_num_seqs, num_snapshots)
            self.runner.model = BroadcastForward(self.runner.model, self.tp)
            if self.spec is not None:  # its own forwards and ring rollbacks reach the other ranks too
                from dsv4_engine.parallel.spec import broadcast_speculator

                broadcast_speculator(self.spec, self.tp, self.pool)
            self.tp.on_failure.append(lambda reason: self.abort(reason=reason, all_=True))
            self.runner.group = self.tp
        # Decode graphs are captured now, before the first request (seconds, not a stall of a live
        # step), and on every rank together at --tp-size > 1; all buckets or none.
        # Any failure falls back to eager decodes, logged and said in /v1/loads (`graphs_status`).
        if self.runner.cuda_graph_max_bs:
            if self.spec is not None:  # its verify and draft steps instead: it never runs a plain decode
                from dsv4_engine.spec_decode.graphs import capture_spec_graphs

                if self.tp is None:
                    capture_spec_graphs(self.spec, self.pool)
                elif args.dp_size > 1:  # each rank its own requests' steps, together (parallel.dp_spec_graphs)
                    from dsv4_engine.parallel.dp_spec_graphs import capture_dp_spec

                    capture_dp_spec(self.spec, self.pool, self.tp, num_pages)
                else:  # the same sets on every rank, together
                    from dsv4_engine.parallel.spec import capture_on_every_rank

                    capture_on_every_rank(self.spec, self.pool, self.tp)
            elif self.tp is None:
                self.runner.capture_graphs(self.pool)
            elif not self.tp.capture_graphs(
                self.runner.cuda_graph_max_bs, lambda agree: self.runner.capture_graphs(self.pool, agree)
            ):
                self.runner.drop_graphs()
        self.prefix_cache: Optional[PrefixCache] = None
        if self.prefix_cache_off is None and args.dp_size > 1:  # a cache per rank (parallel.dp_cache)
            from dsv4_engine.parallel.dp_cache import DPPrefixCache, rank_snapshot_pools

            pools = boundary = None
            if num_snapshots:  # V4: as many snapshots per rank as pages, each copied on its rank
                pools = rank_snapshot_pools(
                    self.pool.slot_states, num_snapshots, args.dp_size, self.tp.send_snapshot_copy
                )
                boundary = snapshot_boundary(specs, page_size)
            self.prefix_cache = DPPrefixCache(self.pool.allocator, page_size, pools, boundary)
            if self.spec is not None and boundary is not None:
                self.spec.cache_boundary = boundary  # drafts stop at boundaries (decode snapshots)
            self.prefix_cache.pins = SessionPins(num_pages * args.dp_size, args.session_ttl, args.session_pin_share)
        elif self.prefix_cache_off is None:
            snaps = SnapshotPool(self.pool.slot_states, num_snapshots) if num_snapshots else None
            boundary = snapshot_boundary(specs, page_size) if snaps is not None else None
            # At --tp-size > 1 a snapshot is copied after a step and each copy repeated on the
            # other ranks (`TPGroup.send_snapshot_copy`); the batch they receive carries no
            # in-forward snapshot rows, so chunks end at the boundaries instead (as on the kernel path).
            in_forward = (
                snaps is not None and self.tp is None and getattr(self.runner.model, "snapshots_in_forward", False)
            )
            if snaps is not None and self.tp is not None:
                snaps.mirror = self.tp.send_snapshot_copy
            interval = 0
            if in_forward:
                every = args.prefix_cache_snapshot_interval
                interval = (
                    (every if every is not None else DEFAULT_SNAPSHOT_BOUNDARIES * boundary) // boundary * boundary
                )
            self.pool.snapshots = snaps
            self.runner.snapshot_states = snaps.states if snaps is not None else None
            self.prefix_cache = PrefixCache(self.pool.allocator, page_size, snaps, boundary, in_forward, interval)
            self.prefix_cache.pins = SessionPins(num_pages, args.session_ttl, args.session_pin_share)
            # a decode serving the next round itself must tell a continuation from a repeat
            self.prefix_cache.record_tips = args.role == "decode"
            if self.spec is not None:
                self.spec.cache_boundary = boundary  # drafts stop at boundaries (decode snapshots)
        refusal = host_tier_refusal(args.host_cache_gb, args.tp_size, self.prefix_cache_off)
        if refusal:
            raise ValueError(refusal)
        refusal = disk_tier_refusal(args.disk_cache_dir, args.disk_cache_gb, args.host_cache_gb)
        if refusal:
            raise ValueError(refusal)
        if args.host_cache_gb > 0:
            self.prefix_cache.host = build_host_tier(self.pool, self.prefix_cache, args.host_cache_gb)
            if args.disk_cache_dir is not None:
                self.prefix_cache.host.disk = DiskTier(args.disk_cache_dir, int(args.disk_cache_gb * (1 << 30)))
        self.scheduler = Scheduler(
            self.pool.allocator,
            page_size,
            args.max_num_seqs,
            args.max_num_batched_tokens,
            self.pool.slots,
            self.prefix_cache,
        )
        if args.dp_size > 1 and self.prefix_cache is not None:  # the rank choice weighs each rank's running requests
            self.prefix_cache.running = lambda: self.scheduler.running
        self._cache_counted = (0, 0)  # prefix cache (query, hit) tokens already added to the counters
        self._host_hits_counted = 0  # of the hits, host-tier tokens already added
        if self.spec is not None:
            self.scheduler.lookahead = self.spec.lookahead
        # The context limit is the model's, but never more than the pool can hold for one request.
        pool_tokens = num_pages * page_size
        self.max_model_len = min(
            args.max_model_len or self.cfg.max_position_embeddings, self.cfg.max_position_embeddings, pool_tokens
        )
        self.metrics = EngineMetrics(args.role, args.served_model_name)
        self.metrics.set("kv_pages_total", num_pages * args.dp_size)  # --dp-size N: a pool per rank
        self.metrics.set("tp_size", args.tp_size)
        self.metrics.set("nnodes", args.nnodes)
        self.rank_metrics = None  # --dp-size N: the per-rank series (parallel.dp_loads)
        if args.dp_size > 1:
            from dsv4_engine.parallel.dp_loads import RankMetrics

            self.rank_metrics = RankMetrics()
        if self.runner.native_build_failures:  # said once at WARNING by dsv4_kernels.native
            self.metrics.inc("native_build_failures", self.runner.native_build_failures)
        if self.runner.eplb is not None:  # expert loads, read at scrape time
            self.metrics.before_render.append(self.runner.eplb.loads.publish)
        for name, nbytes in self.pool.bytes_per_token().items():
            self.metrics.set_state("kv_state_bytes_per_token", name, nbytes)
        for name, nbytes in self.pool.bytes_per_request().items():
            self.metrics.set_state("kv_state_bytes_per_request", name, nbytes)
        self.pd: Optional["RoleController"] = None  # prefill/decode controller, attached by dsv4_engine.pd
        self.seqs: dict[str, Sequence] = {}
        self.inbox: "queue.Queue[Command]" = queue.Queue()
        self.draining = False
        self.last_iteration = time.monotonic()
        self.step_clock = StepClock()  # how long the step in progress may take before /ready fails
        self.step_tally = StepTally()  # steps, seconds and sizes by kind: the planner's performance model
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.failed: Optional[str] = None  # why the device is gone (`device_failed`)
        self.exit_on_device_failure = False  # the serving process sets it: it must not outlive its device
        self.eos_ids = set(self.cfg.eos_token_ids) | set(self.tokenizer.eos_ids)
        self.runner.eos_ids = sorted(self.eos_ids)  # min_tokens holds back the same ids that stop a request
        if self.spec is not None:
            self.spec.eos_ids, self.spec.max_model_len = set(self.eos_ids), self.max_model_len
        # Called on the engine thread after every step: an out-of-process front end sends the
        # outputs the step's sinks collected as one message instead of one per token.
        self.after_step: Optional[Callable[[], None]] = None
        self._grammars = None  # structured outputs' CompileThread, made on the first request that asks
        self._compiling: dict[str, Sequence] = {}  # requests waiting for their grammar, by rid
        # False: outputs carry token ids only, and stop strings are judged by whoever turns them
        # into text (the HTTP process; it ends the request with `finish(seq, "stop")`).
        self.detokenize = True
        phases = switches.read("DSV4_STEP_PHASES")
        if phases not in ("", "0"):
            # "cpu": the loop thread's CPU time per phase, not the wall (its own cost on a loaded machine)
            PHASES.enable(True, self.runner.device, cpu_clock=phases == "cpu")

    # ---- thread-safe entry points ----------------------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        self.inbox.put(AddRequest(seq))

    def abort(
        self, rid: Optional[str] = None, reason: str = "aborted", all_: bool = False, seq: Optional[Sequence] = None
    ) -> None:
        """Abort by rid (admin), everything, or one request object (its client went away: a
        second request reusing the rid must not take the first one down with it)."""
        self.inbox.put(AbortRequest(seq.rid if seq is not None else rid, reason, all_, seq))

    def call(self, fn: Callable[[], None]) -> None:
        """Run fn() on the engine thread (for role controllers and admin actions)."""
        self.inbox.put(Call(fn))

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="dsv4-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)
        if self.tp is not None:
            self.tp.close()

    @property
    def alive(self) -> bool:
        return (
            self._thread is not None
            and self._thread.is_alive()
            and self.failed is None
            and (self.tp is None or self.tp.failed is None)
        )

    def device_failed(self, reason: str) -> None:
        """The device is gone (`device_errors`): /health fails from now on, every request ends
        with the reason, the loop stops and (`exit_on_device_failure`, set by the serving process;
        always at --tp-size > 1, with the group) the process exits, so its requests migrate."""
        self.failed = f"device failed: {reason}"
        log.critical("%s; the engine stops and its process exits", self.failed)
        for seq in list(self.seqs.values()):
            self.finish(seq, "abort", error=f"engine {self.failed}", error_code=500)
        self._stop.set()
        if self.tp is not None:
            self.tp.fail(self.failed)
        elif self.exit_on_device_failure:

            def exit_later() -> None:
                time.sleep(DEVICE_FAIL_GRACE_S)  # the step's outputs reach the HTTP process first
                os._exit(1)

            threading.Thread(target=exit_later, name="dsv4-device-exit", daemon=True).start()

    # ---- the loop --------------------------------------------------------------------------------

    def run(self) -> None:
        use_device(self.runner.device)  # this thread launches every step's kernels
        while not self._stop.is_set():
            try:
                self.step()
            except Exception:  # the loop must outlive any one bad step
                log.error("engine step failed:\n%s", traceback.format_exc())
                time.sleep(0.01)

    def _drain_inbox(self, wait: float) -> None:
        try:
            item = self.inbox.get(timeout=wait) if wait > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: Command) -> None:
        if isinstance(cmd, AddRequest):
            try:
                self._add(cmd.seq)
            except Exception as e:  # e.g. a seed the generator refuses: fail this request only
                self.fail_request(cmd.seq, "request could not be started", e)
        elif isinstance(cmd, AbortRequest):
            if cmd.all:
                targets = list(self.seqs.values())
            else:
                found = self.seqs.get(cmd.rid) if cmd.rid is not None else None
                targets = [found] if found is not None and (cmd.seq is None or found is cmd.seq) else []
            waiting = self._compiling.get(cmd.rid) if cmd.rid is not None else None
            for seq in [*self._compiling.values()] if cmd.all else [waiting] if waiting is not None else []:
                if cmd.seq is None or seq is cmd.seq:  # its grammar still compiling: never admitted
                    self._compiling.pop(seq.rid, None)
                    self._refuse(seq, f"request aborted: {cmd.reason}", 503)
            for seq in targets:
                try:
                    self.finish(seq, "abort", error=f"request aborted: {cmd.reason}", error_code=503)
                except Exception as e:
                    self.fail_request(seq, "abort failed", e)
                self.metrics.inc("num_aborted_reqs")
        elif isinstance(cmd, Call):
            try:
                cmd.fn()
            except Exception:  # a controller's callback must not take the inbox down with it
                log.error("engine call failed:\n%s", traceback.format_exc())
        else:
            log.error("unknown engine command %r", cmd)

    def _refuse(self, seq: Sequence, error: str, code: int) -> None:
        """End a request that was never admitted (it holds no pages, is in no queue)."""
        seq.status, seq.finish_reason = SeqStatus.FINISHED, "error"
        seq.sink(RequestOutput(seq.rid, [], "", True, "error", error, code, len(seq.prompt_ids), 0))

    def queued_requests(self) -> int:
        """Requests admitted that wait to run: the scheduler's waiting queue, and PD's queues
        before it (prefill's bootstrap, decode's prealloc). Those computing or transferring
        are not waiting."""
        return len(self.scheduler.waiting) + (self.pd.waiting() if self.pd is not None else 0)

    def _add(self, seq: Sequence) -> None:
        if seq.rid in self.seqs or seq.rid in self._compiling:
            seq.sink(RequestOutput(seq.rid, [], "", True, "error", f"duplicate request id {seq.rid}", 400))
            return
        bound = self.args.max_queued_requests
        if bound is not None and seq.grammar is None and self.queued_requests() >= bound:
            # refused before anything is registered (no seq, no PD room, no page): a 429 to retry later
            self._refuse(
                seq, f"{QUEUE_FULL}: {bound} requests wait already (--max-queued-requests {bound}); retry later", 429
            )
            self.metrics.inc("num_queue_full_reqs")
            return
        if seq.params.structured is not None and seq.grammar is None:
            # Before the request is queued: a grammar we cannot compile is the client's 400. A
            # grammar not compiled before compiles off this thread (issue 39), then _add again.
            seq.grammar = self.grammars.cached(seq.params.structured)
            if seq.grammar is None:
                self._compiling[seq.rid] = seq
                self.grammars.start(seq.params.structured, lambda compiled, e: self._compiled(seq, compiled, e))
                return
        if self.detokenize:
            seq.detok = IncrementalDetokenizer(self.tokenizer)
            if seq.output_ids:  # a continuation: its text so far was shown by the engine it left
                seq.text = "".join(seq.detok.add(t) for t in seq.output_ids)
                seq.emitted_text_len = max(0, len(seq.text) - max((len(s) - 1 for s in seq.params.stop), default=0))
        if seq.params.seed is not None or not seq.params.greedy:
            seed = seq.params.seed if seq.params.seed is not None else self.args.seed + len(self.seqs)
            seq.generator = request_generator(seed, self.runner.device)
            if not seq.params.greedy:
                # A continuation (a migrated request): its earlier tokens drew from this stream
                # on another engine; move past those draws so the next token draws what it would have.
                for _ in seq.output_ids:
                    skip_draw(seq.generator, self.cfg.vocab_size)
        if seq.share_prefix_of is not None:
            lead = self.seqs.get(seq.share_prefix_of)
            seq.prefix_leader = lead if lead is not None and lead.prompt_ids == seq.prompt_ids else None
        self.seqs[seq.rid] = seq
        self.metrics.inc("prompt_tokens", len(seq.prompt_ids))
        if self.pd is not None:
            self.pd.on_new(seq)
        else:
            self.scheduler.add(seq)

    def _compiled(self, seq: Sequence, compiled, error) -> None:
        """A grammar's compile ended (engine thread): admit its request, or refuse it (400)."""
        if self._compiling.pop(seq.rid, None) is not seq:
            return  # aborted meanwhile
        if error is not None:
            self._refuse(seq, f"invalid structured output: {error}", 400)
            return
        seq.grammar = compiled
        try:
            self._add(seq)
        except Exception as e:
            self.fail_request(seq, "request could not be started", e)

    @property
    def grammars(self):
        """The grammar compiler thread (and its cache of compiled grammars) for this model's vocabulary."""
        if self._grammars is None:
            from dsv4_engine.structured.compile_thread import CompileThread
            from dsv4_engine.structured.grammar import new_compiler

            self._grammars = CompileThread(
                lambda: new_compiler(self.tokenizer.backend, self.cfg.vocab_size, sorted(self.eos_ids)),
                self.call,
                getattr(self.args, "grammar_compile_timeout", 10.0),
            )
        return self._grammars

    def fail_request(self, seq: Sequence, what: str, exc: BaseException, code: Optional[int] = None) -> None:
        """End one request with an error after something went wrong for it alone: the
        exception's own `status` (a 4xx: the request's fault, one line in the log), else 500."""
        if code is None:
            code = exc.status if isinstance(exc, SamplingError) else 500
        if 400 <= code < 500:
            log.warning("%s (request %s): %s", what, seq.rid, exc)
        else:
            log.error(
                "%s (request %s):\n%s",
                what,
                seq.rid,
                "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
            )
        try:
            self.finish(seq, "error", error=f"{what}: {exc}", error_code=code)
            return
        except Exception:
            log.error("finishing request %s failed:\n%s", seq.rid, traceback.format_exc())
        # Last resort: forget it everywhere and tell the client once, without the usual path.
        if self.seqs.get(seq.rid) is seq:
            self.seqs.pop(seq.rid, None)
        try:
            self.scheduler.remove(seq)
        except Exception:
            pass
        if self.pd is not None and seq.pd is not None:
            try:
                self.pd.on_finish(seq)  # out of the PD queues too, the peer told
            except Exception:
                log.error("PD cleanup of %s failed:\n%s", seq.rid, traceback.format_exc())
        try:
            self.scheduler.release(seq)
        except Exception:
            log.error("freeing pages of %s failed:\n%s", seq.rid, traceback.format_exc())
        seq.pages, seq.slot, seq.matcher = [], None, None
        if not seq.finished:
            seq.status = SeqStatus.FINISHED
            seq.finish_reason = "error"
            try:
                seq.sink(
                    RequestOutput(
                        seq.rid, [], "", True, "error", f"{what}: {exc}", code, len(seq.prompt_ids), len(seq.output_ids)
                    )
                )
            except Exception:
                log.error("telling request %s failed:\n%s", seq.rid, traceback.format_exc())

    def step(self) -> None:
        # Block on the inbox only as long as nothing else needs us: not at all with a batch to
        # run, briefly while PD transfers are pending (they are polled, not pushed), else 20 ms.
        if self.scheduler.has_work():
            wait = 0.0
        elif self.pd is not None and self.pd.busy():
            wait = 0.001
        else:
            wait = 0.02
        PHASES.begin()
        self._drain_inbox(wait)
        if self.pd is not None:
            self.pd.poll()
        PHASES.lap("inbox")
        batch = self.scheduler.schedule()
        PHASES.lap("schedule")
        if batch and self.pd is not None:
            self._fault_stall(batch)
        if batch:
            self.step_clock.begin(sum(b.num_new for b in batch))
            forward_started = time.monotonic()
            try:
                results = (
                    self.spec.step(batch, self.pool) if self.spec is not None else self.runner.step(batch, self.pool)
                )
            except Exception as e:  # the forward of this batch failed: fail its requests, keep serving
                log.error("forward failed:\n%s", traceback.format_exc())
                for b in batch:
                    self.fail_request(b.seq, "engine error", e)
                results = []
                fatal = device_failure(e)
                if fatal is not None:  # ... unless the device is gone: then the engine goes too
                    self.step_clock.end()
                    self.device_failed(fatal)
                    return
            self.step_clock.end()
            self.step_tally.record(batch, time.monotonic() - forward_started)
            if self.spec is not None:
                for b, r in zip(batch, results):
                    self._speculated(b, r)
                results = []
            for b, r in zip(batch, results):
                b.seq.num_computed += b.num_new
                self.scheduler.computed(b.seq, b)  # before the token: finishing gives the pages back
                if r is None or b.seq.finished:
                    continue
                try:
                    if isinstance(r, Exception):
                        raise r
                    self._append_token(b.seq, r.token, r.logprob)
                except Exception as e:  # sampling, detokenising, stop handling: this request only
                    self.fail_request(b.seq, "generation failed", e)
            if self.prefix_cache is not None and self.prefix_cache.snapshots is not None:
                self.scheduler.settle(batch)
            PHASES.lap("output")
        self.metrics.inc("scheduler_loop_iterations")
        self.last_iteration = time.monotonic()
        self.update_gauges()
        if self.after_step is not None:
            self.after_step()
        PHASES.lap("after_step")
        PHASES.end(bool(batch))

    def _fault_stall(self, batch) -> None:
        """stall_long_context (fault injection): hang this step when it generates for a request
        whose context has passed the fault's `tokens` (see dsv4_engine.pd.faults)."""
        contexts = [len(b.seq.prompt_ids) + len(b.seq.output_ids) for b in batch if not b.seq.prefill_only]
        f = self.pd.faults.long_context_stall(contexts) if contexts else None
        if f is not None:
            log.error(
                "injected fault: stall_long_context (context %d > %s tokens)", max(contexts), f.get("tokens", "default")
            )
            seconds = f.get("seconds")
            self.pd.faults.hang(float(seconds) if seconds is not None else None)

    def _speculated(self, b, r) -> None:
        """A step's result for one request under speculation (dsv4_engine.spec_decode): the KV
        of `r.computed` tokens became valid, then its tokens are emitted one by one until one of
        them ends the request (the rest are dropped: never past a stop or max_tokens)."""
        seq = b.seq
        if seq.finished:
            return
        if isinstance(r, Exception):
            self.fail_request(seq, "generation failed", r)
            return
        seq.num_computed += b.num_new if r is None else r.computed
        try:
            if r is not None:
                if r.num_drafts:
                    self.spec.observe(self.metrics, r)
                for n, tok in enumerate(r.tokens):
                    self._append_token(seq, tok, r.logprobs[n] if r.logprobs else None)
                    if seq.finished:
                        break
            # once the accepted tokens are in (a finished request is skipped); the snapshots the
            # step wrote inside its chunk are the speculator's kept ones (the rest went back)
            self.scheduler.computed(seq, b)
        except Exception as e:  # detokenising, stop handling: this request only
            self.fail_request(seq, "generation failed", e)

    # ---- per-token bookkeeping -------------------------------------------------------------------

    def _append_token(self, seq: Sequence, tok: int, logprob: Optional[dict] = None) -> None:
        now = time.monotonic()
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.metrics.observe("time_to_first_token_seconds", now - seq.arrival)
        else:
            self.metrics.observe("inter_token_latency_seconds", now - seq.last_token_time)
        seq.last_token_time = now
        seq.output_ids.append(tok)
        if seq.params.logprobs is not None:
            seq.output_logprobs.append(
                logprob if logprob is not None else {"token_id": tok, "logprob": None, "top": []}
            )
        self.metrics.inc("generation_tokens")
        if seq.grammar is not None and not seq.prefill_only:  # the grammar takes the token, exactly once
            from dsv4_engine.structured.bitmask import ensure_matcher

            ensure_matcher(seq)
        seq.matcher = None if seq.prefill_only else seq.matcher  # PD prefill is done with its grammar
        if seq.prefill_only:
            # PD prefill: the first token travels with the KV; decode judges every stop condition.
            self.pd.on_prefill_done(seq)
            return
        reason = self._stop_reason(seq, tok)
        if reason is not None:
            self.finish(seq, reason, new_token=tok)
        else:
            self._emit(seq, [tok])

    def accept_first_token(self, seq: Sequence, tok: int, logprob: Optional[dict] = None) -> None:
        """PD decode: the KV of the prompt has landed with the token prefill sampled (and, when
        the request asked for logprobs, that token's entry as prefill computed it)."""
        try:  # at --tp-size > 1 every rank's pool received its share from prefill (pd.rank_pools)
            self._skip_first_draw(seq)
            self._append_token(seq, tok, logprob)
            if not seq.finished:
                self.scheduler.add_running(seq)
        except Exception as e:
            self.fail_request(seq, "generation failed", e)

    def _skip_first_draw(self, seq: Sequence) -> None:
        """Prefill drew the first token's noise from this request's seeded stream: a seeded
        request samples in PD what it samples in mono only if decode's copy moves past it."""
        if seq.generator is not None and not seq.params.greedy:
            skip_draw(seq.generator, self.cfg.vocab_size)

    def _stop_reason(self, seq: Sequence, tok: int) -> Optional[str]:
        p = seq.params
        if (not p.ignore_eos and tok in self.eos_ids) or tok in p.stop_token_ids:
            return "stop"
        if seq.matcher is not None and seq.matcher.terminated:  # complete, nothing more allowed
            return "stop"
        if self.detokenize:
            seq.text += seq.detok.add(tok)
        if p.stop and self.detokenize and len(seq.output_ids) >= p.min_tokens:  # none before min_tokens (as vLLM)
            start = max(0, seq.emitted_text_len - max(len(s) for s in p.stop))
            hits = [i for i in (seq.text.find(s, start) for s in p.stop) if i >= 0]
            if hits:
                seq.text = seq.text[: min(hits)]
                return "stop"
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _emit(
        self,
        seq: Sequence,
        toks: list[int],
        finished: bool = False,
        reason: Optional[str] = None,
        error: Optional[str] = None,
        error_code: int = 500,
    ) -> None:
        # Hold back text that could still turn into a stop string, until the request ends.
        hold = 0 if finished else max((len(s) - 1 for s in seq.params.stop), default=0)
        upto = max(seq.emitted_text_len, len(seq.text) - hold)
        delta = seq.text[seq.emitted_text_len : upto]
        seq.emitted_text_len = upto
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs = seq.output_logprobs[len(seq.output_logprobs) - len(toks) :] if toks else []
        seq.sink(
            RequestOutput(
                seq.rid,
                toks,
                delta,
                finished,
                reason,
                error,
                error_code,
                len(seq.prompt_ids),
                len(seq.output_ids),
                logprobs,
                seq.num_cached_tokens,
            )
        )

    def finish(
        self,
        seq: Sequence,
        reason: str,
        error: Optional[str] = None,
        error_code: int = 500,
        new_token: Optional[int] = None,
    ) -> None:
        """End a request wherever it is: out of every queue, pages and slot row back, the client told once."""
        if seq.finished:
            return
        seq.error = error
        self.scheduler.remove(seq)
        if self.pd is not None:
            self.pd.on_finish(seq)
        self.scheduler.release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.matcher = None  # the grammar state goes with the request
        self.seqs.pop(seq.rid, None)
        if reason in ("stop", "length"):
            self.metrics.observe("e2e_request_latency_seconds", time.monotonic() - seq.arrival)
        self._emit(seq, [new_token] if new_token is not None else [], True, reason, error, error_code)

    # ---- live state ------------------------------------------------------------------------------

    def update_gauges(self) -> None:
        m = self.metrics
        m.set("num_running_reqs", len(self.scheduler.running))
        m.set("num_queue_reqs", len(self.scheduler.waiting))
        m.set("kv_pages_free", self.pool.allocator.num_free)  # idle cached pages count as free
        if self.prefix_cache is not None:
            c = self.prefix_cache
            m.set("prefix_cache_pages", c.num_cached)
            if c.snapshots is not None:
                m.set("prefix_cache_snapshots", c.snapshots.num_used)
            for name, nbytes in c.bytes_by_state(self.pool.page_bytes_by_state()).items():
                m.set_state("prefix_cache_state_bytes", name, nbytes)
            q, h = self._cache_counted
            if c.query_tokens > q:
                m.inc("prefix_cache_query_tokens", c.query_tokens - q)
            if c.hit_tokens > h:
                m.inc("prefix_cache_hit_tokens", c.hit_tokens - h)
                m.inc_tier("prefix_cache_tier_hit_tokens", "device", max(0, c.hit_tokens - h - self._host_hit_delta(c)))
            m.set_tier("prefix_cache_tier_pages", "device", c.num_cached)
            if c.host is not None:
                m.set_tier("prefix_cache_tier_pages", "host", c.host.num_used)
                if c.host.disk is not None:
                    m.set_tier("prefix_cache_tier_pages", "disk", c.host.disk.num_pages)
                hh = self._host_hits_counted
                if c.host.hit_tokens > hh:
                    m.inc_tier("prefix_cache_tier_hit_tokens", "host", c.host.hit_tokens - hh)
                    self._host_hits_counted = c.host.hit_tokens
            if c.pins is not None:
                m.set("kv_pages_pinned", c.pins.num_pinned)
                m.set("sessions_active", len(c.pins.sessions))
            self._cache_counted = (c.query_tokens, c.hit_tokens)
        if self.rank_metrics is not None:
            self.rank_metrics.publish(m, self.dp_loads())
        if self.pd is not None:
            self.pd.update_gauges(m)

    def _host_hit_delta(self, c: PrefixCache) -> int:
        return c.host.hit_tokens - self._host_hits_counted if c.host is not None else 0

    def _tiers(self) -> dict:
        """Per cache tier: pages held now and prompt tokens served from it (/v1/loads)."""
        c = self.prefix_cache
        host = c.host.hit_tokens if c.host is not None else 0
        out = {"device": {"pages": c.num_cached, "hit_tokens": c.hit_tokens - host}}
        if c.host is not None:
            out["host"] = c.host.stats()
            if c.host.disk is not None:
                out["disk"] = c.host.disk.stats()
        return out

    def _queued_prompt_tokens(self) -> int:
        """Tokens not computed yet of requests still in their prefill: waiting ones, and running ones
        in a chunked prefill (a decoding request has one token pending, its last sampled one)."""
        waiting = sum(max(0, s.num_tokens - s.num_computed) for s in list(self.scheduler.waiting))
        # PD prefill: requests waiting for their decode peer's handshake are queued prompts too.
        booting = getattr(self.pd, "bootstrap", None)
        if isinstance(booting, dict):
            waiting += sum(max(0, s.num_tokens - s.num_computed) for s in list(booting.values()))
        chunked = sum(
            s.num_tokens - s.num_computed for s in list(self.scheduler.running) if s.num_tokens - s.num_computed > 1
        )
        return waiting + chunked

    def dp_loads(self) -> list[dict]:
        """--dp-size N: each rank's running requests, pages and prefix cache (parallel.dp_loads)."""
        from dsv4_engine.parallel.dp_loads import rank_loads

        return rank_loads(self.pool.allocator, list(self.scheduler.running), self.prefix_cache)

    def loads(self) -> dict:
        """Live view for /v1/loads (read from another thread: plain reads of ints are safe)."""
        queues = {"waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running)}
        extra: dict = {}
        if self.pd is not None:
            q, extra = self.pd.loads()
            queues.update(q)
        return {
            "role": self.args.role,
            "model": self.args.served_model_name,
            "tp_size": self.args.tp_size,
            **({"dp_size": self.args.dp_size, "dp_ranks": self.dp_loads()} if self.args.dp_size > 1 else {}),
            **({"nodes": self.tp.describe()} if self.tp is not None and self.args.nnodes > 1 else {}),
            "queues": queues,
            "kv_pages_free": self.pool.allocator.num_free,
            "kv_pages_total": self.pool.allocator.total,  # --dp-size N: every rank's pool
            "kv_slots_free": self.pool.slots.num_free if self.pool.slots is not None else None,
            "kv_slots_total": self.pool.slots.total if self.pool.slots is not None else 0,  # every rank's
            "kv_page_size": self.pool.page_size,
            # which implementation each op runs and why (e.g. "cpu: native", "cpu: reference (...)")
            "kernels": {"backend": self.runner.kernel_backend, "ops": self.runner.kernel_ops},
            # Pages the prefix cache holds; the idle ones (no request uses them) are also counted
            # in kv_pages_free: they are given up as soon as an allocation needs room.
            "kv_pages_cached": self.prefix_cache.num_cached if self.prefix_cache is not None else 0,
            "kv_pages_cached_idle": self.prefix_cache.num_idle if self.prefix_cache is not None else 0,
            "prefix_cache": (
                {
                    "enabled": True,
                    **self.prefix_cache.stats(),
                    # what the cache holds now, per state kind (paged: its pages; slot: snapshots)
                    "bytes_by_state": self.prefix_cache.bytes_by_state(self.pool.page_bytes_by_state()),
                    # per tier: pages held now and prompt tokens served from it; sessions' pins
                    "tiers": self._tiers(),
                    "sessions": self.prefix_cache.pins.stats() if self.prefix_cache.pins is not None else None,
                }
                if self.prefix_cache is not None
                else {"enabled": False, "why": self.prefix_cache_off}
            ),
            # What each state costs: paged ones per token of context, slot ones per running request.
            "kv_state_bytes_per_token": self.pool.bytes_per_token(),
            "kv_state_bytes_per_request": self.pool.bytes_per_request(),
            "speculative": self.spec.loads(self.metrics) if self.spec is not None else None,
            # MoE expert loads per layer (max/mean over experts and over ranks) and the EPLB placement
            "expert_loads": self.runner.eplb.summary() if self.runner.eplb is not None else None,
            # Decode CUDA graphs: on (batch sizes) or why decodes run eagerly; how the pool was sized.
            "cuda_graphs": self.runner.graphs_status(getattr(self.spec, "graphs", None)),
            "kv_sizing": {**self.pool_size.describe(), "kv_cache_dtype": self.kv_cache_dtype},
            "draining": self.draining,
            "seconds_since_last_iteration": round(time.monotonic() - self.last_iteration, 3),
            # The planner's live load (docs/operations.md, "The planner"): prompt tokens waiting to
            # be computed, context held by the running batch, and the forward steps so far by kind.
            "queued_prompt_tokens": self._queued_prompt_tokens(),
            "max_num_seqs": self.args.max_num_seqs,
            "max_num_batched_tokens": self.args.max_num_batched_tokens,
            "running_context_tokens": sum(s.num_tokens for s in list(self.scheduler.running)),
            "steps": self.step_tally.as_dict(),
            "counters": dict(self.metrics.totals),
            # DSV4_STEP_PHASES=1: wall time per phase of the decode / mixed steps (dsv4_engine.step_phases)
            **({"step_phases": PHASES.summary()} if PHASES.on else {}),
            **extra,
        }
