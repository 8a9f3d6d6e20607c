"""The host tier: KV pages the device pool evicts go to host memory and come back on a hit
instead of being recomputed (`--host-cache-gb`).

A second pool of pages, one tensor per paged state, [host_pages, *page shape], in host memory
(pinned on CUDA, so the copies are DMA and do not block the CPU). The prefix cache calls `put`
when it evicts a page from the device (every evicted page goes down: write-back of all; a page
already held here is only touched), and `take` when a request's prefix continues past what the
device holds: the page is copied into a freshly allocated device page and becomes a device node
again (the host keeps its copy, so the page is then in both tiers). The host tier's own LRU
drops its least recently used page when full.

Keys: a page is found by the contract's chain hash (dsv4_wire.kv_events; 128 bits over every
token before it and its own) and its own key tokens, compared exactly. Unlike the device tree,
which compares every token, a host hit relies on the chain hash for what comes before the page:
a 2^-128 collision, the bound vLLM's block hashes also live with.

Copies run on the stream of the step that needs them (CUDA: `non_blocking` from pinned memory;
a device-to-host copy of an evicted page is ordered before the step that overwrites that page,
host-to-device before the step that reads it), so no copy waits on the CPU and none can race.
DeepSeek-V4: a prefix resumes only at a boundary holding a snapshot of the slot row, so the
snapshots a boundary page held go down with it (or alone, when the snapshot pool takes one back
for room), and a request resumes from the host at the deepest boundary whose pages and snapshot
are both there. Refused at --tp-size > 1 (each rank holds its shard of a page).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Optional

import torch


def host_sizes(gb: float, page_nbytes: int, pages_per_boundary: int = 1, row_nbytes: int = 0) -> tuple[int, int]:
    """(host pages, host snapshots) that fit in `gb` GiB: with slot states (DeepSeek-V4) one
    snapshot of a slot row per boundary's worth of pages, both out of the same budget."""
    per = pages_per_boundary * page_nbytes + row_nbytes
    boundaries = int(gb * (1 << 30)) // per if gb > 0 else 0
    return boundaries * pages_per_boundary, (boundaries if row_nbytes else 0)


def host_tier_refusal(gb: float, tp_size: int, prefix_cache_off: Optional[str]) -> Optional[str]:
    """Why --host-cache-gb cannot be used here, in one line, or None."""
    if gb < 0:
        return f"--host-cache-gb must be >= 0, not {gb:g}"
    if gb == 0:
        return None
    if prefix_cache_off is not None:
        return f"--host-cache-gb needs the prefix cache ({prefix_cache_off})"
    if tp_size > 1:
        return (
            "--host-cache-gb: at --tp-size > 1 each rank holds its shard of a page; the host tier copies rank 0's only"
        )
    return None


class HostTier:
    def __init__(
        self,
        states: dict[str, torch.Tensor],
        num_pages: int,
        snapshot_states: Optional[dict[str, torch.Tensor]] = None,
        num_snapshots: int = 0,
    ):
        if num_pages < 1:
            raise ValueError("a host tier needs at least one page")
        self.device_states = states
        pin = any(t.is_cuda for t in states.values())
        self.non_blocking = pin
        # zeros, not empty: every host page is touched here, at start-up, not on its first copy
        # down (first touch cost ~40x the copy itself on the CPU: 5.2 ms vs 0.1 ms per 144 KiB page)
        self.states = {
            name: torch.zeros((num_pages, *t.shape[1:]), dtype=t.dtype, device="cpu", pin_memory=pin)
            for name, t in states.items()
        }
        self.total = num_pages
        # DeepSeek-V4: copies of the prefix cache's slot-row snapshots at boundaries (a prefix
        # resumes only where one is), keyed by their boundary page's hash, LRU of their own.
        self.snapshot_src = snapshot_states or {}
        self.snap_states = {
            name: torch.zeros((num_snapshots, *t.shape[1:]), dtype=t.dtype, device="cpu", pin_memory=pin)
            for name, t in self.snapshot_src.items()
        }
        self.snap_total = num_snapshots if self.snapshot_src else 0
        self._snap_free = list(range(self.snap_total - 1, -1, -1))
        self._snap_lru: "OrderedDict[bytes, int]" = OrderedDict()
        self.snapshots_stored = self.snapshots_restored = 0
        self._free = list(range(num_pages - 1, -1, -1))
        self._lru: "OrderedDict[bytes, tuple[int, tuple]]" = OrderedDict()  # hash -> (slot, key tokens)
        self.on_evict = lambda h: None  # told when the host tier drops a page (kv events)
        self.stored = 0  # pages copied down
        self.disk_restored = 0  # of the pages restored, those read from the disk tier
        self.restored = 0  # pages copied back up
        self.evicted = 0  # pages dropped from the host tier for room
        self.hit_tokens = 0  # prompt tokens served from here
        self.copy_s = 0.0  # engine-thread seconds spent copying (CUDA: enqueueing) pages either way
        # The disk tier below (disk_tier.DiskTier): what this tier drops for room is written there
        # and read back on a hit; None: dropped pages are lost.
        self.disk = None
        self.on_spill = lambda h: None  # told when a dropped page went to disk (kv events)

    @property
    def num_used(self) -> int:
        return len(self._lru)

    def holds(self, h: bytes) -> bool:
        return h in self._lru or (self.disk is not None and self.disk.holds(h))

    def _spill(self, h: bytes, key: tuple, states: dict[str, torch.Tensor], slot: int, suffix: str) -> bool:
        """Write host slot `slot` of `states` to the disk tier before it is reused."""
        if self.non_blocking:  # a copy down into this slot may still be in flight
            torch.cuda.current_stream().synchronize()
        return self.disk.put(h, key, {name: t[slot] for name, t in states.items()}, suffix)

    def put(self, h: bytes, key: tuple, page: int) -> bool:
        """Copy device page `page` (hash h, key tokens `key`) down; True when it is newly held."""
        if h in self._lru:
            self._lru.move_to_end(h)
            return False
        if not self._free:
            old, (slot, old_key) = self._lru.popitem(last=False)
            self._free.append(slot)
            self.evicted += 1
            self.on_evict(old)
            if self.disk is not None and self._spill(old, old_key, self.states, slot, ".page"):
                self.on_spill(old)
        slot = self._free.pop()
        t0 = time.perf_counter()
        for name, t in self.device_states.items():
            self.states[name][slot].copy_(t[page], non_blocking=self.non_blocking)
        self.copy_s += time.perf_counter() - t0
        self._lru[h] = (slot, key)
        self.stored += 1
        return True

    def take(self, h: bytes, key: tuple, page: int) -> bool:
        """Copy the page held under (h, key) into device page `page`; False when not held."""
        got = self._lru.get(h)
        if got is None and self.disk is not None:
            return self._from_disk(h, key, self.device_states, page, ".page")
        if got is None or got[1] != key:
            return False
        slot = got[0]
        t0 = time.perf_counter()
        for name, t in self.device_states.items():
            t[page].copy_(self.states[name][slot], non_blocking=self.non_blocking)
        self.copy_s += time.perf_counter() - t0
        self._lru.move_to_end(h)
        self.restored += 1
        return True

    def _from_disk(self, h: bytes, key: tuple, dst: dict[str, torch.Tensor], index: int, suffix: str) -> bool:
        """Read (h, key) from the disk tier into row `index` of `dst`; False on a miss or a bad file."""
        got = self.disk.read(h, key, {name: t[index] for name, t in dst.items()}, suffix)
        if got is None:
            return False
        t0 = time.perf_counter()
        for name, t in dst.items():
            t[index].copy_(got[name])  # from pageable memory: synchronous, as the read was
        self.copy_s += time.perf_counter() - t0
        if suffix == ".page":
            self.restored += 1
            self.disk_restored += 1
        else:
            self.snapshots_restored += 1
        return True

    def holds_snapshot(self, h: bytes) -> bool:
        return h in self._snap_lru or (self.disk is not None and self.disk.holds(h, ".snap"))

    def put_snapshot(self, h: bytes, snap: int) -> None:
        """Copy the device snapshot `snap` (of the boundary page hashed h) down."""
        if not self.snap_total:
            return
        if h in self._snap_lru:
            self._snap_lru.move_to_end(h)
            return
        if not self._snap_free:
            old, slot = self._snap_lru.popitem(last=False)
            self._snap_free.append(slot)
            if self.disk is not None:
                self._spill(old, (), self.snap_states, slot, ".snap")
        slot = self._snap_free.pop()
        t0 = time.perf_counter()
        for name, t in self.snapshot_src.items():
            self.snap_states[name][slot].copy_(t[snap], non_blocking=self.non_blocking)
        self.copy_s += time.perf_counter() - t0
        self._snap_lru[h] = slot
        self.snapshots_stored += 1

    def take_snapshot(self, h: bytes, rows: dict[str, torch.Tensor], row: int) -> bool:
        """Copy the snapshot held under h into slot row `row` of `rows` (a request's own)."""
        slot = self._snap_lru.get(h)
        if slot is None:
            return self.disk is not None and self._from_disk(h, (), rows, row, ".snap")
        t0 = time.perf_counter()
        for name, t in rows.items():
            t[row].copy_(self.snap_states[name][slot], non_blocking=self.non_blocking)
        self.copy_s += time.perf_counter() - t0
        self._snap_lru.move_to_end(h)
        self.snapshots_restored += 1
        return True

    def stats(self) -> dict:
        return {
            "pages": self.num_used,
            "pages_total": self.total,
            "stored": self.stored,
            "restored": self.restored,
            "evicted": self.evicted,
            "hit_tokens": self.hit_tokens,
            "copy_seconds": round(self.copy_s, 4),
            **({"restored_from_disk": self.disk_restored} if self.disk is not None else {}),
            **(
                {
                    "snapshots": len(self._snap_lru),
                    "snapshots_total": self.snap_total,
                    "snapshots_stored": self.snapshots_stored,
                    "snapshots_restored": self.snapshots_restored,
                }
                if self.snap_total
                else {}
            ),
        }


def build_host_tier(pool, cache, gb: float) -> HostTier:
    """The host tier of a KV pool and its prefix cache, `gb` GiB of host memory."""
    snaps = cache.snapshots
    row = sum(snaps.bytes_per_snapshot().values()) if snaps is not None else 0
    pages, n_snaps = host_sizes(gb, pool.page_nbytes, cache.boundary // cache.page_size, row)
    if pages < 1:
        raise ValueError(f"--host-cache-gb {gb:g} holds no page of this model; raise it or leave it at 0")
    return HostTier(pool.states, pages, snaps.states if snaps is not None else None, n_snaps)
