"""The per-request state pool and the allocators that hand its pages and slot rows out.

The model declares its states (`StateSpec`). Paged states: one page-major tensor each,
[num_pages, num_layers, entries_per_page, *entry_shape], all indexed by the same page ids. A page
of one state is one contiguous byte range, so moving a request's state to another engine is one
descriptor per page per state. A layer's view states[name][:, layer] is what attention reads.
Slot states (DeepSeek-V4's window ring and compressor stages, fixed size per request): one tensor
each, [max_num_seqs, *slot_shape], a row per running request handed out by a `SlotAllocator`.
They live in `slot_states`, apart from `states`, because PD registers `states` page by page.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Callable, Optional, Protocol

import torch

from dsv4_engine.models.state import StateSpec


def page_nbytes(specs: list[StateSpec], page_size: int, dtype: torch.dtype) -> int:
    """Bytes one page costs across every paged state."""
    return sum(spec.page_nbytes(page_size, dtype) for spec in specs if spec.paged)


def slot_row_nbytes(specs: list[StateSpec], dtype: torch.dtype) -> int:
    """Bytes one request's slot row costs across every slot state."""
    return sum(spec.request_nbytes(dtype) for spec in specs)


DEFAULT_PAGE_SIZE = 16


def default_page_size(specs: list[StateSpec]) -> int:
    """Tokens per page when --page-size is not given: 16, or the longest compression window of
    the model's paged states when that is longer. A compressed state keeps one entry slot per
    page at least, so pages shorter than its window leave most of its store empty: DeepSeek-V4's
    HCA (one entry per 128 tokens) in 16-token pages would pay for 8 entries and use one."""
    longest = max((s.tokens_per_entry for s in specs if s.paged), default=1)
    return longest if longest > DEFAULT_PAGE_SIZE else DEFAULT_PAGE_SIZE


def check_page_size(specs: list[StateSpec], page_size: int) -> None:
    """Raise ValueError (one line) when some paged state cannot live in pages of this size."""
    if page_size < 1:
        raise ValueError(f"page size must be at least 1 token, not {page_size}")
    for spec in specs:
        if spec.paged:
            spec.entries_per_page(page_size)  # raises with the state's name and rate


def snapshot_boundary(specs: list[StateSpec], page_size: int) -> int:
    """Token spacing of the positions a model with slot states can resume a cached prefix at:
    a multiple of the page size (the prefix's pages are whole) and of every compression window
    (every entry of those pages is final: a window closing later would write into a page that
    others share). V4-Flash at its default 128-token page: 128; v4-tiny at 16: 16."""
    b = page_size
    for s in specs:
        if s.paged:
            b = math.lcm(b, s.tokens_per_entry)
    return b


def pages_for_memory(
    specs: list[StateSpec],
    page_size: int,
    dtype: torch.dtype,
    memory_gb: float,
    max_num_seqs: int = 0,
    snapshots: int = 0,
) -> int:
    """Pages that fit in `memory_gb` once the slot rows of `max_num_seqs` requests (and the
    prefix cache's `snapshots` copies of a slot row) are reserved."""
    row = slot_row_nbytes(specs, dtype)
    budget = int(memory_gb * (1 << 30)) - (max_num_seqs + snapshots) * row
    if budget <= 0:
        also = f" and {snapshots} prefix-cache snapshots" if snapshots else ""
        raise ValueError(
            f"--kv-memory-gb {memory_gb} does not cover the per-request state of --max-num-seqs {max_num_seqs}{also} "
            f"({row / (1 << 20):.2f} MiB each); raise it or lower --max-num-seqs"
        )
    return max(1, budget // page_nbytes(specs, page_size, dtype))


class KVPool:
    def __init__(
        self,
        specs: list[StateSpec],
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_num_seqs: int = 0,
    ):
        if not any(spec.paged for spec in specs):
            raise ValueError("a model must declare at least one paged state")
        check_page_size(specs, page_size)
        self.specs = {spec.name: spec for spec in specs}
        self.page_size = page_size
        self.num_pages = num_pages
        self.states: dict[str, torch.Tensor] = {
            spec.name: torch.zeros(
                num_pages, *spec.page_shape(page_size), dtype=spec.storage_dtype(dtype), device=device
            )
            for spec in specs
            if spec.paged
        }
        self.allocator = PageAllocator(num_pages)
        slot_specs = [spec for spec in specs if not spec.paged]
        self.num_slots = max_num_seqs if slot_specs else 0
        self.slot_states: dict[str, torch.Tensor] = {
            spec.name: torch.zeros(self.num_slots, *spec.slot_shape(), dtype=spec.storage_dtype(dtype), device=device)
            for spec in slot_specs
        }
        # None when the model keeps nothing per request outside its pages (DeepSeek-V3).
        self.slots: SlotAllocator | None = SlotAllocator(self.num_slots) if slot_specs else None
        # The prefix cache's copies of slot rows (set by the engine when it builds one).
        self.snapshots: SnapshotPool | None = None

    @property
    def all_states(self) -> dict[str, torch.Tensor]:
        """Every state tensor by name, what the model's forward takes."""
        return {**self.states, **self.slot_states} if self.slot_states else self.states

    @property
    def tensor(self) -> torch.Tensor:
        """The first declared state (the only one for DeepSeek-V3)."""
        return next(iter(self.states.values()))

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page across every state."""
        return sum(t[0].numel() * t.element_size() for t in self.states.values())

    def page_bytes_by_state(self) -> dict[str, int]:
        """Bytes one page costs in each paged state."""
        # numel // pages, not t[0].numel(): no view made (the engine asks every step)
        return {name: t.numel() // t.shape[0] * t.element_size() for name, t in self.states.items()}

    def bytes_per_token(self) -> dict[str, float]:
        """What each paged state costs per token of context (for /v1/loads and sizing)."""
        return {name: t[0].numel() * t.element_size() / self.page_size for name, t in self.states.items()}

    def bytes_per_request(self) -> dict[str, int]:
        """What each slot state costs per running request, whatever its length."""
        return {name: t[0].numel() * t.element_size() for name, t in self.slot_states.items()}


class PageAllocator:
    """Reference-counted page ids. A page handed out by `allocate` has one reference; `share`
    adds one (a request reusing a cached prefix page), `free` drops one, and a page whose last
    reference goes is free again, unless the prefix cache keeps it (then it stays cached and
    idle until `allocate` needs room and the cache gives it up, least recently used first).
    Dropping a reference nobody holds is a bug we want loudly, since a page leak (or a page two
    requests write) is how a PD engine slowly wedges or corrupts output."""

    def __init__(self, num_pages: int):
        self.total = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._refs: dict[int, int] = {}
        self._lock = threading.RLock()
        self.cache: Optional["PageKeeper"] = None  # the prefix cache, when one is attached

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out now: free ones and idle cached ones (reclaimable)."""
        return len(self._free) + (self.cache.num_idle if self.cache is not None else 0)

    @property
    def num_unused(self) -> int:
        """Pages neither referenced nor cached."""
        return len(self._free)

    def refcount(self, page: int) -> int:
        return self._refs.get(page, 0)

    def allocate(self, n: int) -> list[int] | None:
        """n pages with one reference each, or None (and nothing taken nor evicted) when fewer
        than n are free or reclaimable."""
        with self._lock:
            short = n - len(self._free)
            if short > 0:
                if self.cache is None or short > self.cache.num_idle:
                    return None
                self._free.extend(self.cache.evict(short))
            pages = [self._free.pop() for _ in range(n)]
            for p in pages:
                self._refs[p] = 1
            return pages

    def allocate_beside(self, held: list[int], n: int) -> list[int] | None:
        """n more pages for a request holding `held` (one pool: anywhere; a data-parallel
        engine's books keep a request's pages on its rank: parallel.dp_pages)."""
        return self.allocate(n)

    def same_pool(self, a: list[int], b: list[int]) -> bool:
        """Whether freeing pages `a` makes room for a request holding `b` (one pool: always)."""
        return True

    def share(self, pages: list[int]) -> None:
        """One more reference on each page (held ones, or idle cached ones taken back)."""
        with self._lock:
            for p in pages:
                if p in self._refs:
                    self._refs[p] += 1
                elif self.cache is not None and self.cache.holds(p):
                    self._refs[p] = 1
                    self.cache.on_referenced(p)
                else:
                    raise RuntimeError(f"page {p} shared while neither held nor cached")

    def free(self, pages: list[int]) -> None:
        """Drop one reference on each page; the last one frees it (or leaves it cached, idle)."""
        with self._lock:
            for p in pages:
                n = self._refs.get(p, 0)
                if n <= 0:
                    raise RuntimeError(f"page {p} freed twice or never allocated (reference count underflow)")
                if n > 1:
                    self._refs[p] = n - 1
                    continue
                del self._refs[p]
                if self.cache is not None and self.cache.holds(p):
                    self.cache.on_unreferenced(p)
                else:
                    self._free.append(p)


class PageKeeper(Protocol):
    """What the allocator asks of a cache that keeps unreferenced pages (the prefix cache)."""

    @property
    def num_idle(self) -> int: ...

    def holds(self, page: int) -> bool: ...

    def on_unreferenced(self, page: int) -> None: ...

    def on_referenced(self, page: int) -> None: ...

    def evict(self, n: int) -> list[int]: ...


class SlotAllocator:
    """A free list of slot rows (one per running request). Same contract as pages: every row
    handed out comes back exactly once."""

    follows_pages = False  # a row is taken at admission (parallel.dp_pages.DPSlotAllocator: after the pages)

    def __init__(self, num_slots: int):
        self.total = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
            self._used.add(slot)
            return slot

    def free(self, slot: int) -> None:
        with self._lock:
            if slot not in self._used:
                raise RuntimeError(f"slot row {slot} freed twice or never allocated")
            self._used.remove(slot)
            self._free.append(slot)


def copy_snapshot(
    snapshots: dict[str, torch.Tensor], slot_states: dict[str, torch.Tensor], kind: str, snap: int, row: int
) -> None:
    """ "save": slot row `row` into snapshot `snap`; "restore": the other way (every slot state)."""
    if kind not in ("save", "restore"):
        raise ValueError(f"unknown snapshot copy {kind!r}")
    for name, t in snapshots.items():
        if kind == "save":
            t[snap].copy_(slot_states[name][row])
        else:
            slot_states[name][row].copy_(t[snap])


class SnapshotPool:
    """Copies of slot rows taken at cached prefix boundaries (the prefix cache of a model with
    slot states: DeepSeek-V4's window ring and compressor stages). One tensor per slot state,
    [num_snapshots, *row], beside the pool's slot rows; a snapshot is a row index into them.

    A snapshot is owned by the cache node of its boundary. A request reusing it copies it into
    its own slot row (`restore`) and never writes the snapshot, so requests hold no reference
    on it: every snapshot is always reclaimable. When none is free, `save` takes the least
    recently used one (saved or restored longest ago) and tells its owner through `on_evict`."""

    def __init__(self, slot_states: dict[str, torch.Tensor], num_snapshots: int):
        if not slot_states:
            raise ValueError("a snapshot pool needs slot states to copy")
        if num_snapshots < 1:
            raise ValueError(
                f"the prefix cache of a model with slot states needs at least 1 snapshot, not {num_snapshots}"
            )
        self.total = num_snapshots
        self.slot_states = slot_states
        self.states = {
            name: torch.zeros(num_snapshots, *t.shape[1:], dtype=t.dtype, device=t.device)
            for name, t in slot_states.items()
        }
        self._free = list(range(num_snapshots - 1, -1, -1))
        self._lru: "OrderedDict[int, None]" = OrderedDict()  # held snapshots, least recently used first
        self._pending: set[int] = set()  # reserved for a step that writes them
        self.on_evict: Callable[[int], None] = lambda snap: None
        # Called after every copy, as ("save" | "restore", snapshot, row): at --tp-size > 1 each
        # rank keeps its own copy of every slot row, so the other ranks repeat the copy.
        self.mirror: Optional[Callable[[str, int, int], None]] = None
        self.saved = 0  # snapshots taken
        self.restored = 0  # snapshots copied into a request's row
        self.evicted = 0  # snapshots taken back for room

    @property
    def num_used(self) -> int:
        return len(self._lru)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def holds(self, snap: int) -> bool:
        return snap in self._lru

    def bytes_per_snapshot(self) -> dict[str, int]:
        # numel // pages, not t[0].numel(): no view made (the engine asks every step)
        return {name: t.numel() // t.shape[0] * t.element_size() for name, t in self.states.items()}

    def reserve(self) -> int:
        """A snapshot row to be written (by the model's forward, or `save`): free, or the least
        recently used held one taken back. Not reclaimable until `commit` or `release`."""
        if not self._free:
            if not self._lru:
                raise RuntimeError("every snapshot is reserved")
            victim, _ = self._lru.popitem(last=False)
            self.evicted += 1
            self.on_evict(victim)
            self._free.append(victim)
        snap = self._free.pop()
        self._pending.add(snap)
        return snap

    def commit(self, snap: int, recent: bool = True) -> None:
        """A reserved snapshot was written: held from now on, as the most recent one, or with
        recent=False as the next to go (a speculative one: it moves up once restored)."""
        self._pending.remove(snap)
        self._lru[snap] = None
        if not recent:
            self._lru.move_to_end(snap, last=False)
        self.saved += 1

    def demote(self, snap: int) -> None:
        """A held snapshot becomes the next to go when room is needed (superseded by a deeper one)."""
        if snap in self._lru:
            self._lru.move_to_end(snap, last=False)

    def release(self, snap: int) -> None:
        """A reserved snapshot is not needed after all (its step failed, or the boundary already
        had one): free again."""
        self._pending.remove(snap)
        self._free.append(snap)

    @property
    def num_reserved(self) -> int:
        return len(self._pending)

    def save(self, row: int) -> int:
        """Copy slot row `row` of every slot state into a snapshot; its id."""
        snap = self.reserve()
        copy_snapshot(self.states, self.slot_states, "save", snap, row)
        if self.mirror is not None:
            self.mirror("save", snap, row)
        self.commit(snap)
        return snap

    def restore(self, snap: int, row: int) -> None:
        """Copy a snapshot into slot row `row` (the request's own); it becomes the most recent."""
        if snap not in self._lru:
            raise RuntimeError(f"snapshot {snap} restored while not held")
        copy_snapshot(self.states, self.slot_states, "restore", snap, row)
        if self.mirror is not None:
            self.mirror("restore", snap, row)
        self._lru.move_to_end(snap)
        self.restored += 1

    def drop(self, snap: int) -> None:
        """Give a snapshot back (its owner forgot it)."""
        if snap not in self._lru:
            raise RuntimeError(f"snapshot {snap} dropped twice or never saved")
        del self._lru[snap]
        self._free.append(snap)
