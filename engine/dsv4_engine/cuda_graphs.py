"""Decode steps replayed from captured CUDA graphs.

A decode step is the same sequence of kernels whatever its content, once its shapes are fixed:
the batch is padded up to one of a few bucket sizes, the block table has a fixed width (the
most pages a request can hold) and every per-step input lives in a static buffer that the
graph reads. For each bucket a graph is captured once; a step then copies its inputs into the
static buffers (from pinned host memory, without waiting) and replays the graph: one launch
for the whole forward instead of ~20 per layer from Python.

Padding rows repeat the batch's first request (same token, same position, same KV slot): they
write the very value the real row writes to the same slot and their logits are dropped, so no
page of another request is touched and no spare page is needed.

What makes the forward capturable is checked on CPU by tests/unit/engine/test_cuda_graphs.py:
no host reads (see test_host_syncs.py), no shape that depends on values, the same ops and
allocations for two steps of different content in one bucket, and at most
DECODE_DISPATCHES_PER_LAYER dispatches (torch ops + kernel launches) per layer.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import numpy as np
import torch

from dsv4_engine.batch_buffers import HostBatch

log = logging.getLogger(__name__)

# Dispatches (aten ops, views included, + Triton launches) one DeepSeek-V3 decode layer may
# issue on the Triton backend. Measured on `tiny` (1 dense + 3 MoE layers, 3-4 requests):
# 384 in 4 layers, 96 a layer, of which ~10 kernel launches of ours (rmsnorm x2-3, rope x2,
# mla_decode split + merge, moe route, gate/up, down), ~20 matmuls/bmms/elementwise, ~10
# index/cat/put, and the rest views and dtype no-ops (free in a graph). The test holds it here:
# more means Python overhead every eager step pays and that a graph must hide.
DECODE_DISPATCHES_PER_LAYER = 100
# The same for a DeepSeek-V4 decode layer (mHC mixing twice, compressor stages and their masked
# window close, the indexer): measured on v4-tiny, see test_cuda_graphs.py.
V4_DECODE_DISPATCHES_PER_LAYER = 330  # 314 measured (39 kernel launches in 4 layers)


# --cuda-graph-max-bs when not given: graphs on by default wherever they are supported (CUDA, the
# Triton backend, a capture-safe model), for batches up to this many requests (or --max-num-seqs).
DEFAULT_GRAPH_MAX_BS = 64


def resolve_graph_max_bs(requested: Optional[int], max_num_seqs: int) -> int:
    """The largest captured batch: the flag when given (0 = off), else min(max_num_seqs, 64)."""
    if requested is None:
        return min(max_num_seqs, DEFAULT_GRAPH_MAX_BS)
    return requested


Agree = Callable[[Optional[str]], Optional[str]]


def alone(failure: Optional[str]) -> Optional[str]:
    """The agreement of a group of one: its own verdict."""
    return failure


def capture_buckets(
    buckets: list[int], capture_one: Callable[[int], None], agree: Agree = alone, what: str = "decode"
) -> Optional[str]:
    """Capture each bucket in turn; after each, every rank says how it went (`agree` takes this
    rank's failure line or None and returns the group's first one). The first failure anywhere
    ends capture on every rank at the same bucket, so no rank goes on to a warm-up whose
    collectives the others never join. Returns that failure line, or None when all captured."""
    for bs in buckets:
        failure = None
        try:
            capture_one(bs)
        except Exception as e:  # out of memory, a capture-unsafe op, a kernel that does not compile
            first = (str(e).strip().splitlines() or [""])[0][:300]
            failure = f"capturing the {what} graph of batch size {bs} failed: {type(e).__name__}: {first}"
        failure = agree(failure)
        if failure is not None:
            return failure
    return None


def graph_buckets(max_bs: int) -> list[int]:
    """Padded batch sizes with a captured graph: 1, 2, 4, 8, then every 8 up to max_bs (and
    max_bs itself). A step pads to the smallest bucket that holds it: at most 7 wasted rows
    past 8, at most half below."""
    if max_bs <= 0:
        return []
    sizes = {b for b in (1, 2, 4) if b <= max_bs} | set(range(8, max_bs + 1, 8)) | {max_bs}
    return sorted(sizes)


def bucket_for(n: int, buckets: list[int]) -> Optional[int]:
    """The smallest bucket holding n rows, or None when n is past the largest."""
    for b in buckets:
        if b >= n:
            return b
    return None


def pad_decode(hb: HostBatch, bucket: int) -> HostBatch:
    """hb padded to `bucket` rows by repeating row 0 (one token per request: a decode step)."""
    n = hb.seq_lens.shape[0]
    take = np.concatenate([np.arange(n), np.zeros(bucket - n, dtype=np.int64)])
    return HostBatch(
        input_ids=hb.input_ids[take],
        positions=hb.positions[take],
        slot_mapping=hb.slot_mapping[take],
        block_table=hb.block_table[take],
        seq_lens=hb.seq_lens[take],
        extend_lens=hb.extend_lens[take],
        logits_indices=np.arange(bucket, dtype=np.int64),
        slot_ids=None if hb.slot_ids is None else hb.slot_ids[take],
    )


class StaticDecodeInputs:
    """The buffers a captured decode step reads: sized for the largest bucket, with a block
    table of fixed width, on the device; a pinned host twin of each for the copies."""

    FIELDS = {
        "input_ids": torch.int64,
        "positions": torch.int64,
        "slot_mapping": torch.int64,
        "seq_lens": torch.int32,
        "extend_lens": torch.int32,
        "logits_indices": torch.int64,
        "slot_ids": torch.int64,
    }  # rows in the slot states (V4); unused by V3

    def __init__(self, max_bs: int, width: int, device: torch.device):
        pin = device.type == "cuda"
        self.device = device
        self.dev = {k: torch.zeros(max_bs, dtype=dt, device=device) for k, dt in self.FIELDS.items()}
        self.dev["block_table"] = torch.zeros(max_bs, width, dtype=torch.int32, device=device)
        self.host = {k: torch.zeros(v.shape, dtype=v.dtype, pin_memory=pin) for k, v in self.dev.items()}
        self.dev["extend_lens"].fill_(1)
        self.dev["logits_indices"].copy_(torch.arange(max_bs))
        self._copied: Optional[torch.cuda.Event] = None
        # Columns of the block table at and past this one are zero in every row.
        self._table_used = 0

    def load(self, hb: HostBatch) -> None:
        """Copy a padded batch's arrays into the first rows of the static buffers. The block table
        goes as wide as the batch uses (its longest request's pages), not the captured width (the
        model's whole context: 8,192 columns for V4-Flash): the host bytes of a step follow the
        batch, not the model. Columns a wider step left behind are zeroed on the device, so each
        row reads as the zero-padded table it would have been."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the pinned buffers
        for k in self.dev:
            src = getattr(hb, k)
            if src is None:  # slot_ids of a model without slot states
                continue
            n = src.shape[0]  # rows (an extend step's token fields have more: ExtendGraphs)
            if k == "block_table":
                self._load_table(src)
                continue
            self.host[k][:n].numpy()[:] = src
            self.dev[k][:n].copy_(self.host[k][:n], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _load_table(self, src: np.ndarray) -> None:
        n, w = src.shape
        dev = self.dev["block_table"]
        staged = self.host["block_table"].view(-1)[: n * w].view(n, w)  # contiguous: one async copy
        staged.numpy()[:] = src
        dev[:n, :w].copy_(staged, non_blocking=True)
        if w < self._table_used:
            dev[:, w : self._table_used].zero_()  # on the device, in stream order: no host bytes
        self._table_used = w

    def view(self, bs: int) -> dict[str, torch.Tensor]:
        return {k: v[:bs] for k, v in self.dev.items()}


def warmup_batch(width: int) -> HostBatch:
    """The one-row decode the start-up capture runs on (before any request exists): token 0 at
    position 0 of page 0, slot row 0. It writes only page 0 and slot row 0 of the fresh pool,
    which the runner zeroes again after capturing."""
    one = np.zeros(1, dtype=np.int64)
    return HostBatch(
        input_ids=one,
        positions=one,
        slot_mapping=one,
        block_table=np.zeros((1, width), dtype=np.int32),
        seq_lens=np.ones(1, dtype=np.int32),
        extend_lens=np.ones(1, dtype=np.int32),
        logits_indices=one,
        slot_ids=one,
    )


class DecodeGraphs:
    """Decode forwards for batches up to max_bs rows, one captured graph per bucket.

    `run_forward(inputs, bs)` runs the model on the static buffers' first bs rows and returns
    its logits [bs, vocab]. With capture=False (CPU, or to test) the same padded step runs
    eagerly on the same buffers: what the tests check is what the graph would replay.
    Graphs are captured by `capture_all` (at start-up), all buckets or none.
    """

    # Errors only for this thread's capture-unsafe calls: other threads of the process (the TP
    # watchdog, NIXL, a bootstrap server) may use CUDA while the engine captures.
    CAPTURE_ERROR_MODE = "thread_local"

    def __init__(
        self,
        run_forward: Callable[[dict[str, torch.Tensor], int], torch.Tensor],
        max_bs: int,
        width: int,
        device: torch.device,
        capture: bool,
        buckets: Optional[list[int]] = None,
    ):
        self.run_forward = run_forward
        self.buckets = buckets or graph_buckets(max_bs)  # the speculator's steps have their own
        self.width = width
        self.device = device
        self.capture = capture and device.type == "cuda"
        self.inputs = StaticDecodeInputs(self.buckets[-1], width, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.name = "decode"  # what the log lines call these graphs

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def fits(self, n: int, max_pages: int) -> bool:
        return bucket_for(n, self.buckets) is not None and max_pages <= self.width

    def capture_all(self, agree: Agree = alone) -> Optional[str]:
        """Capture every bucket, largest first (its memory pool then serves the smaller ones),
        on the warm-up batch, agreeing with the other ranks after each (`capture_buckets`). All
        or none: on the first failure anywhere every graph is dropped and the reason comes back
        as one line (None: all captured, or nothing to capture here)."""
        if not self.capture:
            return None
        self.inputs.load(self._padded(self._warmup(), self.buckets[-1]))

        def one(bs: int) -> None:
            self._capture_one(bs)
            if bs == self.buckets[0]:
                self._synchronize()  # the last bucket: a fault of any replay-to-be shows here

        failure = capture_buckets(list(reversed(self.buckets)), one, agree, self.name)
        if failure is not None:
            self.graphs.clear()
            self.outputs.clear()
            self.pool = None
            return failure
        log.info("captured %s CUDA graphs for batch sizes %s", self.name, self.buckets)
        return None

    def _capture_one(self, bs: int) -> None:
        """Two eager runs on a side stream first (Triton compiles, allocator settles; at tp > 1
        they also run the all-reduces on every rank together), then the capture."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.run_forward(self.inputs.view(bs), bs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=self.CAPTURE_ERROR_MODE):
            self.outputs[bs] = self.run_forward(self.inputs.view(bs), bs)
        self.pool = graph.pool()
        self.graphs[bs] = graph

    def _synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    # What a step of another shape overrides (spec_decode.graphs.ExtendGraphs: n tokens a row).
    def _padded(self, hb: HostBatch, bs: int) -> HostBatch:
        return pad_decode(hb, bs)

    def _warmup(self) -> HostBatch:
        return warmup_batch(self.width)

    def _out_rows(self, hb: HostBatch) -> int:
        return hb.seq_lens.shape[0]

    def step(self, hb: HostBatch) -> torch.Tensor:
        """Logits [n, vocab] of a decode batch (block table `width` columns wide): the captured
        graph of its bucket replayed, or (not captured) the same padded step run eagerly."""
        n = hb.seq_lens.shape[0]
        bs = bucket_for(n, self.buckets)
        self.inputs.load(self._padded(hb, bs))
        rows = self._out_rows(hb)
        if self.graphs:
            self.graphs[bs].replay()
            return self.outputs[bs][:rows]
        return self.run_forward(self.inputs.view(bs), bs)[:rows]
