"""The seam PD moves per-request state over: "write these pages (and this slot row) into that
peer's pages (and row), tell it with this notification, and tell me DONE or FAILED".

A pool has two kinds of state region (`PoolStates`): paged ones, page-major and sharing page ids
(every model), and slot ones, one row per running request (DeepSeek-V4's window ring and
compressor stages). Each region is described to the wire once, with what must match between
the two sides for bytes to be copied unit for unit: its kind, name, dtype, shape and bytes of a
page or row, tokens per entry (a compressed state's rate), and the pool's tokens per page.

Contract every transport keeps (NIXL in production, the in-process fake in tests, the fault
wrapper around either):
- `descriptor()` is a JSON-able dict a peer gives to `add_peer`. It lists every state region
  of the pool; `add_peer` refuses a peer whose layout differs in any way with a `LayoutError`
  naming the difference, before anything moves.
- `write_pages(peer, src, dst, notif, src_slot=, dst_slot=)` moves page `src[i]` of EVERY paged
  region into page `dst[i]` of the same region on the peer, and (when the pool has slot
  regions) row `src_slot` of every slot region into row `dst_slot`; the peer's `poll_notifs`
  yields `notif` once all of it has landed (an empty notif sends none). A pool with slot
  regions must name both rows; bad pages or rows, or an unknown peer, raise ValueError before
  anything starts; a transfer that cannot start (peer gone) returns a handle already FAILED.
  `ready` (a CUDA event, `pages_ready`) is what the pages' writers must reach before the copy
  reads them; without it a device transport waits for its whole current stream.
- `poll(handle)` never raises for transfer faults and ends DONE or FAILED (a dead peer is a
  FAILED with a disconnect error). It may stay PENDING forever only for a stalled transfer;
  the controller's deadline is what catches that, not the transport.
- `info(handle).nbytes_by_state` says what the transfer moves per region.
- `release(handle)` forgets a transfer (cancelling it if still pending); `close()` is
  idempotent. One owner thread drives a transport; `add_peer` may come from another thread.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Protocol, Sequence, Union, runtime_checkable

import torch

PAGE, SLOT = "page", "slot"


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class LayoutError(ValueError):
    """The peer's state regions cannot receive ours page for page and row for row."""


@dataclass
class TransferInfo:
    """What the owner needs for metrics and logs about one transfer."""

    handle: int
    peer: str
    num_pages: int
    nbytes: int  # across every region
    state: TransferState
    error: Optional[str]
    started_at: float  # time.monotonic()
    finished_at: Optional[float]
    nbytes_by_state: dict[str, int] = field(default_factory=dict)

    @property
    def elapsed_s(self) -> float:
        end = self.finished_at if self.finished_at is not None else time.monotonic()
        return end - self.started_at


@dataclass(frozen=True)
class Region:
    """One state of the pool as the wire sees it: a tensor whose unit i (page i of a paged
    region, row i of a slot region) is one contiguous byte range of `nbytes`."""

    name: str
    dtype: str  # e.g. "float32", "bfloat16"
    shape: tuple[int, ...]  # of one page / one row
    nbytes: int
    kind: str = PAGE
    tokens_per_entry: int = 1  # a compressed state's rate; 1 for plain per-token state

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "tokens_per_entry": self.tokens_per_entry,
        }

    @classmethod
    def from_dict(cls, d: object) -> "Region":
        if not isinstance(d, dict):
            raise ValueError(f"region must be a dict, got {type(d).__name__}")
        name, dtype, shape, nbytes = d.get("name"), d.get("dtype"), d.get("shape"), d.get("nbytes")
        kind, tpe = d.get("kind", PAGE), d.get("tokens_per_entry", 1)
        if not isinstance(name, str) or not name or not isinstance(dtype, str) or not dtype:
            raise ValueError(f"region needs a non-empty name and dtype, got {d!r}")
        if kind not in (PAGE, SLOT):
            raise ValueError(f"region {name!r} kind must be {PAGE!r} or {SLOT!r}, got {kind!r}")
        if not isinstance(shape, list) or not shape or not all(_pos_int(x) for x in shape):
            raise ValueError(f"region {name!r} shape must be positive integers, got {shape!r}")
        if not _pos_int(nbytes) or not _pos_int(tpe):
            raise ValueError(
                f"region {name!r} nbytes and tokens_per_entry must be positive integers, got {nbytes!r}, {tpe!r}"
            )
        return cls(name, dtype, tuple(shape), nbytes, kind, tpe)


def _pos_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


@dataclass
class PoolStates:
    """The tensors a transport moves: paged regions (sharing page ids) and slot regions (sharing
    row ids), with what a peer must agree on (tokens per page and per entry)."""

    pages: Mapping[str, torch.Tensor]
    slots: Mapping[str, torch.Tensor] = field(default_factory=dict)
    page_size: int = 0  # tokens per page; 0 when not stated (a bare tensor pool)
    tokens_per_entry: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def of_pool(cls, pool: Any) -> "PoolStates":
        """The states of an engine's `KVPool`."""
        return cls(
            dict(pool.states),
            dict(pool.slot_states),
            pool.page_size,
            {name: spec.tokens_per_entry for name, spec in pool.specs.items()},
        )

    @classmethod
    def of(cls, states: Union["PoolStates", Mapping[str, torch.Tensor], torch.Tensor]) -> "PoolStates":
        if isinstance(states, PoolStates):
            return states
        if isinstance(states, torch.Tensor):
            return cls({"kv": states})  # a single-state pool
        return cls(dict(states))

    @property
    def num_pages(self) -> int:
        return int(next(iter(self.pages.values())).shape[0])

    @property
    def num_slots(self) -> int:
        return int(next(iter(self.slots.values())).shape[0]) if self.slots else 0

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every region's tensor, paged ones first, in the order of `regions()`."""
        return {**self.pages, **self.slots}

    def regions(self) -> list[Region]:
        return regions_of(self.pages, self.slots, self.tokens_per_entry)

    def layout(self) -> "Layout":
        return Layout(tuple(self.regions()), self.page_size)


def _region(name: str, t: torch.Tensor, kind: str, tpe: int) -> Region:
    return Region(
        name,
        # a uint8 state is FP8 KV with its scales (dsv4_engine.kv_quant): named so in a refusal
        "fp8_e4m3" if t.dtype == torch.uint8 else str(t.dtype).removeprefix("torch."),
        tuple(int(x) for x in t.shape[1:]),
        t[0].numel() * t.element_size(),
        kind,
        tpe,
    )


def regions_of(
    states: Mapping[str, torch.Tensor],
    slot_states: Optional[Mapping[str, torch.Tensor]] = None,
    tokens_per_entry: Optional[Mapping[str, int]] = None,
) -> list[Region]:
    """The regions of a pool's states, paged ones then slot ones, each in declaration order;
    checks each is unit-major (page-major / row-major) and shares its kind's unit count."""
    if not states:
        raise ValueError("a pool needs at least one paged state region")
    tpe = tokens_per_entry or {}
    out = []
    for kind, group, unit in ((PAGE, states, "pages"), (SLOT, slot_states or {}, "slot rows")):
        count = None
        for name, t in group.items():
            if not isinstance(t, torch.Tensor) or t.dim() < 2 or not t.is_contiguous() or t.numel() == 0:
                raise ValueError(
                    f"state {name!r} must be a contiguous non-empty tensor [num_{unit.replace(' ', '_')}, ...]"
                )
            if count is not None and t.shape[0] != count:
                raise ValueError(
                    f"state {name!r} has {t.shape[0]} {unit}, the others {count}: they share {unit[:-1]} ids"
                )
            count = t.shape[0]
            out.append(_region(name, t, kind, int(tpe.get(name, 1))))
    if len({r.name for r in out}) != len(out):
        raise ValueError("a state name is both paged and slot")
    return out


@dataclass(frozen=True)
class Layout:
    """What two pools must share for bytes to be copied unit for unit: every region, and the
    tokens per page (0: not stated)."""

    regions: tuple[Region, ...]
    page_size: int = 0

    def mismatch(self, other: "Layout") -> Optional[str]:
        if self.page_size and other.page_size and self.page_size != other.page_size:
            return f"page size {self.page_size} != {other.page_size} tokens"
        return layout_mismatch(self.regions, other.regions)


def layout_mismatch(mine: Sequence[Region], theirs: Sequence[Region]) -> Optional[str]:
    """Why units of `mine` cannot be copied byte for byte into units of `theirs`, or None."""
    for kind in (PAGE, SLOT):
        names = [r.name for r in mine if r.kind == kind]
        other = [r.name for r in theirs if r.kind == kind]
        if names != other:
            what = "state regions" if kind == PAGE else "slot state regions"
            return f"{what} {names} != {other}"
    for a, b in zip(mine, theirs):
        what = f"{a.kind} region {a.name}"
        if a.dtype != b.dtype:
            if "fp8_e4m3" in (a.dtype, b.dtype):
                return (
                    f"{what}: KV cache dtype {a.dtype} != {b.dtype} "
                    "(prefill and decode must run with the same --kv-cache-dtype)"
                )
            return f"{what}: dtype {a.dtype} != {b.dtype}"
        if a.tokens_per_entry != b.tokens_per_entry:
            return f"{what}: compress rate {a.tokens_per_entry} != {b.tokens_per_entry} tokens per entry"
        if a.shape != b.shape:
            return f"{what}: {a.kind} shape {list(a.shape)} != {list(b.shape)}"
        if a.nbytes != b.nbytes:
            return f"{what}: {a.kind} size {a.nbytes} B != {b.nbytes} B"
    return None


def check_layout(mine: Union[Layout, Sequence[Region]], theirs: Union[Layout, Sequence[Region]], peer: str) -> None:
    mine = mine if isinstance(mine, Layout) else Layout(tuple(mine))
    theirs = theirs if isinstance(theirs, Layout) else Layout(tuple(theirs))
    why = mine.mismatch(theirs)
    if why:
        raise LayoutError(f"peer {peer!r} has an incompatible KV layout: {why}")


def check_slot_mapping(src_slot: Optional[int], dst_slot: Optional[int], num_src: int, num_dst: int) -> None:
    """A pool with slot regions moves exactly one row per transfer; one without moves none."""
    if num_src == 0 and num_dst == 0:
        if src_slot is not None or dst_slot is not None:
            raise ValueError("this pool has no slot state regions: no slot row to move")
        return
    for name, slot, limit in (("src_slot", src_slot, num_src), ("dst_slot", dst_slot, num_dst)):
        if not isinstance(slot, int) or isinstance(slot, bool):
            raise ValueError(f"{name} must be a slot row (the pool has slot state regions), got {slot!r}")
        if not 0 <= slot < limit:
            raise ValueError(f"{name} {slot} is outside [0, {limit})")


def slot_args(src_slot: Optional[int], dst_slot: Optional[int]) -> dict:
    """write_pages' slot keywords, only when a row moves (so a wrapper around a transport of a
    slot-less pool passes nothing new)."""
    return {} if src_slot is None and dst_slot is None else {"src_slot": src_slot, "dst_slot": dst_slot}


def pages_ready(t: torch.Tensor) -> Optional[Any]:
    """An event on the current stream of `t`'s device, recorded once the kernels that wrote a
    request's pages are queued: a transport waits for it (that work only), not for the whole
    stream, once for however many writes share it. None on CPU: nothing runs ahead there."""
    if not t.is_cuda:
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(t.device))
    return ev


def ready_arg(ready: Optional[Any]) -> dict:
    """write_pages' `ready` keyword, only when there is an event to wait for (as `slot_args`)."""
    return {} if ready is None else {"ready": ready}


def transfer_bytes(regions: Sequence[Region], num_pages: int, with_slot: bool) -> dict[str, int]:
    """Bytes a transfer of `num_pages` pages (and one slot row) moves, per region."""
    return {r.name: r.nbytes * (num_pages if r.kind == PAGE else int(with_slot)) for r in regions}


@runtime_checkable
class KVTransport(Protocol):
    """See the module docstring for the contract."""

    @property
    def name(self) -> str: ...

    def descriptor(self) -> dict: ...

    def add_peer(self, desc: dict) -> str: ...

    def write_pages(
        self,
        peer: str,
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
        notif: bytes,
        *,
        src_slot: Optional[int] = None,
        dst_slot: Optional[int] = None,
        ready: Optional[Any] = None,
    ) -> int: ...

    def poll(self, handle: int) -> TransferState: ...

    def error(self, handle: int) -> Optional[str]: ...

    def info(self, handle: int) -> TransferInfo: ...

    def release(self, handle: int) -> None: ...

    def poll_notifs(self) -> list[tuple[str, bytes]]: ...

    def close(self) -> None: ...
