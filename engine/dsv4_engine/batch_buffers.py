"""Per-step batch tensors built without per-token Python loops, in persistent buffers.

A step's scheduled requests become flat arrays (token ids, positions, KV slots, a block table)
computed with numpy over all requests at once, written into preallocated host buffers (pinned
on CUDA) and copied to preallocated device buffers with non-blocking copies. Nothing here reads
from the device, so building a batch never waits for the GPU; the one wait is before reusing
the pinned buffers, for the previous step's copy (not its compute) to have left them.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Optional

import numpy as np
import torch


@dataclass
class HostBatch:
    """A step in host arrays: what build_batch computes before any copy."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    block_table: np.ndarray  # [B, width] int32, zero past each request's pages
    seq_lens: np.ndarray  # [B] int32
    extend_lens: np.ndarray  # [B] int32
    logits_indices: np.ndarray  # [B] int64
    slot_ids: Optional[np.ndarray]  # [B] int64, or None when some request has no slot


def host_batch(
    starts: list[int],
    news: list[int],
    pages: list[list[int]],
    tokens: list[list[int]],
    slots: list[Optional[int]],
    page_size: int,
    width: Optional[int] = None,
) -> HostBatch:
    """The flat arrays of one step. Request b computes tokens starts[b]..starts[b]+news[b]-1
    (tokens[b] are their ids), its KV pages are pages[b]; width (default: the most pages any
    request has) is the block table's column count."""
    B = len(news)
    start = np.asarray(starts, dtype=np.int64)
    new = np.asarray(news, dtype=np.int64)
    npages = np.fromiter(map(len, pages), dtype=np.int64, count=B)
    flat_pages = np.fromiter(chain.from_iterable(pages), dtype=np.int64, count=int(npages.sum()))
    total = int(new.sum())
    req = np.repeat(np.arange(B), new)  # request of each token
    row_start = np.cumsum(new) - new
    pos = start[req] + np.arange(total) - row_start[req]
    page_start = np.cumsum(npages) - npages
    slot = flat_pages[page_start[req] + pos // page_size] * page_size + pos % page_size
    width = max(1, int(npages.max()) if B else 1) if width is None else width
    table = np.zeros((B, width), dtype=np.int32)
    owner = np.repeat(np.arange(B), npages)
    table[owner, np.arange(flat_pages.size) - page_start[owner]] = flat_pages
    ids = np.fromiter(chain.from_iterable(tokens), dtype=np.int64, count=total)
    return HostBatch(
        input_ids=ids,
        positions=pos,
        slot_mapping=slot,
        block_table=table,
        seq_lens=(start + new).astype(np.int32),
        extend_lens=new.astype(np.int32),
        logits_indices=row_start + new - 1,
        slot_ids=None if any(s is None for s in slots) else np.asarray(slots, dtype=np.int64),
    )


class _Buffer:
    """One flat array: a host staging tensor (pinned on CUDA) and its device twin, grown by
    doubling when a step needs more than they hold."""

    def __init__(self, dtype: torch.dtype, device: torch.device, capacity: int = 256):
        self.dtype, self.device = dtype, device
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        if self.device.type == "cpu":
            self.host = torch.empty(capacity, dtype=self.dtype)
            self.dev = self.host  # the device is the host: no copy
        else:
            self.host = torch.empty(capacity, dtype=self.dtype, pin_memory=True)
            self.dev = torch.empty(capacity, dtype=self.dtype, device=self.device)

    def put(self, values: np.ndarray) -> torch.Tensor:
        """A device tensor holding values (shape kept), valid until the next put."""
        n = values.size
        if n > self.capacity:
            self._alloc(max(n, 2 * self.capacity))
        self.host[:n].numpy()[:] = values.reshape(-1)
        if self.dev is not self.host:
            self.dev[:n].copy_(self.host[:n], non_blocking=True)
        return self.dev[:n].view(values.shape)


class BatchBuffers:
    """The persistent buffers every step's batch is copied into."""

    NAMES = {
        "input_ids": torch.int64,
        "positions": torch.int64,
        "slot_mapping": torch.int64,
        "block_table": torch.int32,
        "seq_lens": torch.int32,
        "extend_lens": torch.int32,
        "logits_indices": torch.int64,
        "slot_ids": torch.int64,
    }

    def __init__(self, device: torch.device):
        self.device = device
        self.bufs = {name: _Buffer(dt, device) for name, dt in self.NAMES.items()}
        self._copied: Optional[torch.cuda.Event] = None

    def upload(self, hb: HostBatch) -> dict[str, Optional[torch.Tensor]]:
        """Device tensors of hb. On CUDA the copies are asynchronous; the pinned buffers are
        reused only once the previous step's copies have finished reading them."""
        if self._copied is not None:
            self._copied.synchronize()
        out = {
            name: (None if getattr(hb, name) is None else buf.put(getattr(hb, name))) for name, buf in self.bufs.items()
        }
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return out
