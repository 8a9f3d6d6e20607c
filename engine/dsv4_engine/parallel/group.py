"""The process group of one engine over N ranks, as rank 0 sees it and as the others join it.

Rank 0 is the engine: it serves HTTP, schedules, samples. It spawns ranks 1..N-1 as child
processes (`python -m dsv4_engine.parallel.worker`), and every step broadcasts the batch to them
(`wire`: a fixed header + one int64 payload) before running its own shard of the forward.

Two groups: `control` (gloo, CPU tensors, a long timeout: the other ranks wait on it while the
engine idles) carries the batch; `compute` (NCCL on CUDA, gloo on CPU, a short timeout) carries
the all-reduces inside the forward. A rank that dies or hangs takes the engine down loudly:
- rank 0's watchdog polls its children; one that exits fails the group;
- a collective that raises on rank 0 fails the group (the ranks cannot resync);
- a step (or state copy) that waits on the other ranks longer than STEP_TIMEOUT_S fails the group:
  the watchdog times it, since a blocked send on gloo's rendezvous or a hung NCCL kernel may
  never raise by itself (a rank that is alive but stopped);
- a failed group aborts every request (clients get errors), /health fails, and after
  FAIL_GRACE_S (time for those errors to reach the clients) the process exits 1;
- the other ranks exit when rank 0 goes (they watch their parent) or a collective fails.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from dsv4_engine.kv_sizing import DeviceMemory
from dsv4_engine.parallel import wire
from dsv4_engine.parallel.layout import NodeLayout, set_socket_interface
from dsv4_engine.parallel.node_channel import NodeServer, config_fingerprint, group_secret
from dsv4_engine.parallel.plan import Shard
from dsv4_engine.parallel.ranks import LocalRanks, node_timeout_s, step_timeout_s

log = logging.getLogger("dsv4.tp")


STEP_TIMEOUT_S = step_timeout_s()
CONTROL_TIMEOUT = timedelta(days=7)  # the other ranks wait for the next batch while the engine idles
FAIL_GRACE_S = 2.0
WATCH_INTERVAL_S = 0.2


def rank_device(device: Optional[str], rank: int) -> str:
    """The device of one rank by its local rank (its place on its host): cuda:(base + rank) on
    CUDA, cpu otherwise."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    d = torch.device(device)
    if d.type != "cuda":
        return str(d)
    return f"cuda:{(d.index or 0) + rank}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_refusal(
    device: Optional[str], size: int, device_count: Optional[int] = None, nnodes: int = 1
) -> Optional[str]:
    """Why this host's `size` ranks cannot each have their device (local rank r on cuda:base+r),
    in one line, or None; checked before any rank starts, not left to a rank's 'invalid device
    ordinal'. `size`: the ranks of this host (--tp-size / --nnodes)."""
    if device is None or torch.device(device).type != "cuda":
        return None
    count = torch.cuda.device_count() if device_count is None else device_count
    base = torch.device(device).index or 0
    if base + size > count:
        flag = f"--tp-size {size}" if nnodes == 1 else f"--tp-size {size * nnodes} over --nnodes {nnodes}"
        per = "" if nnodes == 1 else " on each node"
        return (
            f"{flag} needs {size} GPUs{per} from cuda:{base} (one per rank); this host has {count} "
            f"visible (CUDA_VISIBLE_DEVICES)"
        )
    return None


@dataclass
class TPRank:
    """One rank's place in the group: what the sharded model and the batch channel use."""

    shard: Shard
    compute: object  # process group of the forward's all-reduces
    control: object  # process group of the batch broadcasts
    data_parallel: bool = False  # --dp-size N: attention per rank over its own requests (parallel.dp_attention)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks (gloo sums float32 only exactly as we want: upcast others)."""
        y = x if x.dtype == torch.float32 or x.is_cuda else x.float()
        y = y.contiguous()
        dist.all_reduce(y, group=self.compute)
        return y if y.dtype == x.dtype else y.to(x.dtype)


def join(shard: Shard, init: "int | str", device: str, layout: Optional[NodeLayout] = None) -> TPRank:
    """Join (or, on rank 0, open) the group; blocks until every rank is in. `init`: a port on
    127.0.0.1 (every rank on this host) or a torch init method (tcp://HOST:PORT, node 0's)."""
    init_method = f"tcp://127.0.0.1:{init}" if isinstance(init, int) else init
    set_socket_interface(layout or NodeLayout(shard.size))
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=init_method,
        rank=shard.rank,
        world_size=shard.size,
        timeout=timedelta(seconds=STEP_TIMEOUT_S),
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TPRank(shard, dist.group.WORLD, control)


class TPGroup:
    """Rank 0's handle on the group: spawns this host's other ranks, admits the other nodes' (with
    --nnodes), sends them each batch, watches them all."""

    def __init__(self, size: int, engine_args: dict, device: Optional[str], layout: Optional[NodeLayout] = None):
        layout = layout or NodeLayout(size)
        per_node = layout.ranks_per_node
        refusal = device_refusal(rank_device(device, 0), per_node, nnodes=layout.nnodes)
        if refusal:
            raise ValueError(refusal)
        self.size = size
        self.failed: Optional[str] = None
        self.on_failure: list[Callable[[str], None]] = []
        self.exit_on_failure = True  # a serving process must not outlive its group
        self._lock = threading.Lock()
        self._closing = False
        self._busy_since: Optional[float] = None  # when the step now talking to the other ranks began
        self._loading = False  # while rank 0 waits for the other ranks' loads (named in a failure)
        # Heartbeats older than this (wall clock) are not held against a rank: moved forward when
        # this process itself was frozen (a suspended host or terminal stops every rank alike).
        self._beat_floor = time.time()
        if layout.dist_init_addr is None:  # one host: a rendezvous on loopback
            layout = replace(layout, dist_init_addr=f"127.0.0.1:{free_port()}")
        self.layout = layout
        self.nodes: Optional[NodeServer] = None
        if layout.multi_node:  # before any rank starts: a busy port is one clear line
            try:
                self.nodes = NodeServer(
                    layout.channel_port,
                    {
                        "nnodes": layout.nnodes,
                        "tp_size": size,
                        "model": config_fingerprint(engine_args.get("model", "")),
                    },
                    node_timeout_s(),
                    group_secret(),
                )
            except OSError as e:
                raise RuntimeError(
                    f"the node channel cannot listen on port {layout.channel_port} (--dist-init-addr port + 1): {e}"
                ) from None
        self._started = time.monotonic()
        # This host's other ranks (local ranks 1..), each on its own device.
        ranks = layout.local_ranks()
        self.local = LocalRanks(
            ranks[1:],
            size,
            layout.init_method(),
            engine_args,
            {r: i for i, r in enumerate(ranks)},
            str(layout.init_port),
        )
        self._watch = threading.Thread(target=self._watch_ranks, name="dsv4-tp-watchdog", daemon=True)
        self._watch.start()
        self._threads = torch.get_num_threads()
        if torch.device(rank_device(device, 0)).type == "cpu":  # the ranks share this host's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))
        try:
            self.rank = join(Shard(0, size), layout.init_method(), rank_device(device, 0), layout)
        except Exception as e:
            missing = self.nodes.missing() if self.nodes is not None else []
            if missing:
                raise RuntimeError(self._missing_nodes(missing)) from e
            raise

    # Compatibility: what tests and the status read of this host's ranks.
    @property
    def procs(self) -> list:
        return list(self.local.procs.values())

    def _missing_nodes(self, missing: list[int]) -> str:
        return (
            f"node{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of --nnodes {self.layout.nnodes} "
            f"did not join within {STEP_TIMEOUT_S:g} s (node 0 waits at {self.layout.dist_init_addr} and port "
            f"{self.layout.channel_port}; is `dsv4 serve --node-rank N --dist-init-addr {self.layout.dist_init_addr}` "
            "running there?)"
        )

    def describe(self) -> dict:
        """The group's shape for /v1/loads: nodes, and this host's ranks."""
        out: dict = {"nnodes": self.layout.nnodes, "node_ranks": self.layout.ranks_per_node}
        if self.nodes is not None:
            out["nodes"] = self.nodes.describe()
        return out

    # ---- the step channel --------------------------------------------------------------------

    def tightest_memory(self, own: Optional[DeviceMemory]) -> Optional[DeviceMemory]:
        """The least free device memory of any rank once all have loaded their weights (every
        rank mirrors rank 0's pool, so the tightest one sizes it). The other ranks may still be
        loading: waited for as `announce_pool` waits."""
        self._loading = True
        try:
            with self.step("waiting for the other ranks to load their weights", timed=False):
                return tightest_memory(own, self.rank)
        finally:
            self._loading = False

    def announce_pool(self, num_pages: int, page_size: int, max_num_seqs: int, num_snapshots: int = 0) -> None:
        """Tell the other ranks the size of the KV pool to build (theirs mirrors rank 0's, the
        prefix cache's slot-row snapshots included). The
        other ranks may still be loading their weights: however long that takes, a rank whose
        heartbeat stops for STEP_TIMEOUT_S (a stopped process, alive to the watchdog's poll) fails
        the start, which would otherwise wait forever."""
        self._loading = True
        try:
            with self.step("waiting for the other ranks to load their weights", timed=False):
                dist.broadcast(
                    torch.tensor([num_pages, page_size, max_num_seqs, num_snapshots], dtype=torch.int64),
                    0,
                    group=self.rank.control,
                )
        finally:
            self._loading = False
        if self.nodes is not None:  # every rank loaded: the other nodes' agents turn ready
            self.nodes.announce_ready()

    def send_batch(self, fb) -> None:
        header, payload = wire.pack(fb)
        dist.broadcast(header, 0, group=self.rank.control)
        dist.broadcast(payload, 0, group=self.rank.control)

    def send_graph_step(self, hb) -> None:
        """A captured decode step: its host arrays (no device read), replayed by every rank."""
        header, payload = wire.pack_host(hb)
        dist.broadcast(header, 0, group=self.rank.control)
        dist.broadcast(payload, 0, group=self.rank.control)

    def capture_graphs(self, max_bs: int, capture: Callable[[Callable], bool], what: str = "decode") -> bool:
        """Every rank captures its decode graphs now, together: the warm-up forwards run the
        all-reduces, so the ranks do them in the same order, and after each batch size all say
        how it went (`agree_failure`), so a failure on any rank ends capture on all of them at
        that size. Then all keep them or all drop them (a rank without graphs could not replay
        rank 0's captured steps). `capture(agree)` captures rank 0's; a speculating group's
        ranks capture the speculator's steps instead (`what`: "speculative", parallel.spec)."""
        with self.step("capturing CUDA graphs on every rank", timed=False):
            dist.broadcast(wire.capture_header(max_bs), 0, group=self.rank.control)
            ok = capture(lambda failure: agree_failure(failure, self.rank))
            agreed = all_ranks_agree(ok, self.rank)
        if ok and not agreed:
            log.warning("CUDA graphs off: another rank could not capture its %s graphs (its log says why)", what)
        return agreed

    @contextlib.contextmanager
    def step(self, what: str, timed: bool = True):
        """Time a step that talks to the other ranks (the watchdog fails one that takes too
        long); any failure inside is the group's."""
        if self.failed is not None:
            raise RuntimeError(f"tensor-parallel group failed: {self.failed}")
        self._busy_since = time.monotonic() if timed else None
        try:
            yield
        except Exception as e:
            # A collective that breaks is most often a rank that just failed: name that failure.
            own = f"{what} failed: {type(e).__name__}: {e}"
            reason = self._rank_exit(wait_s=2.0)
            self.fail(reason or own)
            # The rank watcher may have failed the group first, with the rank's own line (and
            # removed its file since, so that reason read here lacks it): name the first one.
            named = self.failed or reason
            if named and named != own:
                raise RuntimeError(f"tensor-parallel group failed: {named}") from e
            raise
        finally:
            self._busy_since = None

    def gather_rank_pools(self, desc: dict) -> list[dict]:
        """PD decode: every rank registers its own pool with its own KV transport, and rank 0
        learns their descriptors (`desc`: its own; returned: every rank's, rank 0's first), which
        prefill then writes each rank's share into (`pd.rank_pools`)."""
        with self.step("registering every rank's KV pool for PD", timed=False):
            dist.broadcast(wire.op_header(wire.OP_PD_POOLS), 0, group=self.rank.control)
            return gather_descriptors(desc, self.rank)

    def send_snapshot_copy(self, kind: str, snap: int, row: int) -> None:
        """Prefix cache (V4): rank 0 copied a slot row into a snapshot or back; every rank keeps
        its own slot rows (replicated attention), so each repeats the copy on its own. Sent on the
        control channel between the steps, in the order rank 0 did them (a restore before the
        forward that reads the row, a save after the one that wrote it)."""
        with self.step("copying a prefix-cache snapshot on the other ranks"):
            header, payload = wire.snapshot_message(kind, snap, row)
            dist.broadcast(header, 0, group=self.rank.control)
            dist.broadcast(payload, 0, group=self.rank.control)

    # ---- failure -----------------------------------------------------------------------------

    def fail(self, reason: str) -> None:
        """The group is broken for good: tell the engine, then exit the process after a grace."""
        with self._lock:
            if self.failed is not None or self._closing:
                return
            self.failed = reason
        self._remove_error_files()  # read already (the reason names them); the process may not get to it
        if self.nodes is not None:  # the other nodes stop their ranks at once, with the reason
            self.nodes.announce_failure(reason)
        log.critical("tensor-parallel group failed: %s; the engine goes down in %.1f s", reason, FAIL_GRACE_S)
        print(f"dsv4: tensor-parallel group failed: {reason}", file=sys.stderr, flush=True)
        for cb in self.on_failure:
            try:
                cb(reason)
            except Exception:
                log.error("failure callback raised:\n%s", traceback.format_exc())
        if self.exit_on_failure:
            threading.Thread(target=self._exit_later, name="dsv4-tp-exit", daemon=True).start()

    def _exit_later(self) -> None:
        time.sleep(FAIL_GRACE_S)
        self._kill_ranks()
        os._exit(1)

    def _rank_exit(self, wait_s: float = 0.0) -> Optional[str]:
        """Why a rank or a node is gone: 'rank r (pid) exited with code c: why' for the first of
        this host's ranks found gone, else the node channel's reason (another node lost, or a
        node's rank gone), waiting up to wait_s for one; or None."""
        deadline = time.monotonic() + wait_s
        while True:
            found = self.local.exited() or (self.nodes.failure() if self.nodes is not None else None)
            if found is not None or time.monotonic() >= deadline:
                return found
            time.sleep(0.05)

    def _watch_ranks(self) -> None:
        last_round = time.time()
        while not self._closing and self.failed is None:
            now = time.time()
            if now - last_round > STEP_TIMEOUT_S / 2:  # this process was frozen too: not the ranks' fault
                self._beat_floor = now
            last_round = now
            gone = self._rank_exit()
            if gone is not None and not self._closing:
                self.fail(gone)
                return
            silent = self._silent_rank()
            if silent is not None:
                self.fail(silent)
                return
            since = self._busy_since
            if since is not None and time.monotonic() - since > STEP_TIMEOUT_S:
                self.fail(f"a step waited on the other ranks for more than {STEP_TIMEOUT_S:g} s (a rank is hung)")
                return
            missing = self.nodes.missing() if self.nodes is not None else []
            if missing and time.monotonic() - self._started > STEP_TIMEOUT_S:
                self.fail(self._missing_nodes(missing))
                return
            time.sleep(WATCH_INTERVAL_S)

    def _silent_rank(self) -> Optional[str]:
        """The first of this host's ranks whose heartbeat is older than STEP_TIMEOUT_S (a stopped
        process, alive to the watchdog's poll), or None. Judged whether or not a step is under
        way, so that an idle engine's /health also fails; a rank that has not written its first
        beat yet (still starting) is left to the group's join timeout. (Other nodes judge their
        own ranks the same way and report on the node channel.)"""
        return self.local.silent(STEP_TIMEOUT_S, self._beat_floor, self._loading)

    def _kill_ranks(self) -> None:
        self.local.kill()
        if self.nodes is not None:
            self.nodes.close()

    def _remove_error_files(self) -> None:
        self.local.remove_files()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the other ranks (orderly when the group still works) and leave the group."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        deadline = time.monotonic() + timeout
        teller: Optional[threading.Thread] = None
        if self.failed is None:
            if self.nodes is not None:  # the other nodes' ranks exit next: not a failure
                self.nodes.announce_stop()

            # In a thread: a hung rank would hold the send forever; it is killed below instead.
            def tell_stop() -> None:
                try:
                    dist.broadcast(wire.stop_header(), 0, group=self.rank.control)
                except Exception:
                    log.warning("could not tell the other ranks to stop:\n%s", traceback.format_exc())

            teller = threading.Thread(target=tell_stop, name="dsv4-tp-stop", daemon=True)
            teller.start()
            teller.join(timeout)
        self.local.wait(max(0.1, deadline - time.monotonic()))
        if self.nodes is not None:
            self.nodes.close()
        torch.set_num_threads(self._threads)
        self._remove_error_files()
        if teller is not None and teller.is_alive():
            return  # a send still pending on a killed rank: the group goes with the process
        try:
            dist.destroy_process_group()
        except Exception:
            pass


UNKNOWN_BYTES = 1 << 62  # a rank whose device reports no memory (CPU) leaves the minimum to the others


def tightest_memory(own: Optional[DeviceMemory], rank: TPRank) -> Optional[DeviceMemory]:
    """On every rank: the least free (and least total) device memory over the ranks, or None
    when no rank's device reports its memory."""
    t = torch.tensor([own.free, own.total] if own is not None else [UNKNOWN_BYTES] * 2, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=rank.control)
    free, total = t.tolist()
    return None if free >= UNKNOWN_BYTES else DeviceMemory(free, total)


def agree_failure(failure: Optional[str], rank: TPRank) -> Optional[str]:
    """Every rank's verdict on the step all just did (None: it went well), gathered on every
    rank: the first failure, naming its rank, or None when none failed. Each rank calls it the
    same number of times (`cuda_graphs.capture_buckets` stops all at the same bucket)."""
    lines: list[Optional[str]] = [None] * dist.get_world_size(rank.control)
    dist.all_gather_object(lines, failure, group=rank.control)
    for r, line in enumerate(lines):
        if line is not None:
            return f"rank {r}: {line}"
    return None


def gather_descriptors(desc: dict, rank: TPRank) -> list[dict]:
    """Every rank's transport descriptor, in rank order, on every rank."""
    out: list[Optional[dict]] = [None] * dist.get_world_size(rank.control)
    dist.all_gather_object(out, desc, group=rank.control)
    return out


def all_ranks_agree(ok: bool, rank: TPRank) -> bool:
    """True on every rank when `ok` is true on every rank (a MIN over the control group)."""
    flag = torch.tensor([int(bool(ok))], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=rank.control)
    return bool(flag.item())


class BroadcastForward:
    """Rank 0's model: every forward first reaches the other ranks. Any failure here is the
    group's (the ranks' collectives are out of step), never one batch's alone."""

    def __init__(self, model, group: TPGroup):
        self.model = model
        self.group = group

    def forward(self, fb, states):
        with self.group.step("a step on rank 0"):
            self.group.send_batch(fb)
            return self.model.forward(fb, states)

    def __getattr__(self, name):
        return getattr(self.model, name)
