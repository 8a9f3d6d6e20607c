"""The seam PD moves per-request state over: "write these pages into that peer's pages, tell it
with this notification, and tell me DONE or FAILED".

Contract every transport keeps (NIXL in production, the in-process fake in tests, the fault
wrapper around either):
- `descriptor()` is a JSON-able dict a peer gives to `add_peer`. It lists every state region
  of the pool (name, dtype, page shape, page bytes); `add_peer` refuses a peer whose regions
  differ in any of those with a `LayoutError` naming the difference, before anything moves.
- `write_pages(peer, src, dst, notif)` moves page `src[i]` of EVERY region into page `dst[i]`
  of the same region on the peer; the peer's `poll_notifs` yields `notif` once all of it has
  landed (an empty notif sends none). Bad pages or an unknown peer raise ValueError before
  anything starts; a transfer that cannot start (peer gone) returns a handle already FAILED.
- `poll(handle)` never raises for transfer faults and ends DONE or FAILED (a dead peer is a
  FAILED with a disconnect error). It may stay PENDING forever only for a stalled transfer;
  the controller's deadline is what catches that, not the transport.
- `release(handle)` forgets a transfer (cancelling it if still pending); `close()` is
  idempotent. One owner thread drives a transport; `add_peer` may come from another thread.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Mapping, Optional, Protocol, Sequence, runtime_checkable

import torch


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class LayoutError(ValueError):
    """The peer's state regions cannot receive ours page for page."""


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

    @property
    def elapsed_s(self) -> float:
        end = self.finished_at if self.finished_at is not None else time.monotonic()
        return end - self.started_at


@dataclass(frozen=True)
class Region:
    """One state of the pool as the wire sees it: a page-major tensor whose page i is one
    contiguous byte range of `page_nbytes`."""

    name: str
    dtype: str  # e.g. "float32", "bfloat16"
    page_shape: tuple[int, ...]
    page_nbytes: int

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "page_shape": list(self.page_shape), "page_nbytes": self.page_nbytes}

    @classmethod
    def from_dict(cls, d: object) -> "Region":
        if not isinstance(d, dict):
            raise ValueError(f"region must be a dict, got {type(d).__name__}")
        name, dtype, shape, nbytes = d.get("name"), d.get("dtype"), d.get("page_shape"), d.get("page_nbytes")
        if not isinstance(name, str) or not name or not isinstance(dtype, str) or not dtype:
            raise ValueError(f"region needs a non-empty name and dtype, got {d!r}")
        if not isinstance(shape, list) or not shape or not all(_pos_int(x) for x in shape):
            raise ValueError(f"region {name!r} page_shape must be positive integers, got {shape!r}")
        if not _pos_int(nbytes):
            raise ValueError(f"region {name!r} page_nbytes must be a positive integer, got {nbytes!r}")
        return cls(name, dtype, tuple(shape), nbytes)


def _pos_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def regions_of(states: Mapping[str, torch.Tensor]) -> list[Region]:
    """The regions of a pool's states, in declaration order; checks each is page-major."""
    if not states:
        raise ValueError("a pool needs at least one state region")
    num_pages = None
    out = []
    for name, t in states.items():
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or not t.is_contiguous() or t.numel() == 0:
            raise ValueError(f"state {name!r} must be a contiguous non-empty tensor [num_pages, ...]")
        if num_pages is not None and t.shape[0] != num_pages:
            raise ValueError(f"state {name!r} has {t.shape[0]} pages, the others {num_pages}: they share page ids")
        num_pages = t.shape[0]
        out.append(Region(name, str(t.dtype).removeprefix("torch."), tuple(int(x) for x in t.shape[1:]),
                          t[0].numel() * t.element_size()))
    return out


def layout_mismatch(mine: Sequence[Region], theirs: Sequence[Region]) -> Optional[str]:
    """Why pages of `mine` cannot be copied byte for byte into pages of `theirs`, or None."""
    names, other = [r.name for r in mine], [r.name for r in theirs]
    if names != other:
        return f"state regions {names} != {other}"
    for a, b in zip(mine, theirs):
        if a.dtype != b.dtype:
            return f"region {a.name}: dtype {a.dtype} != {b.dtype}"
        if a.page_shape != b.page_shape:
            return f"region {a.name}: page shape {list(a.page_shape)} != {list(b.page_shape)}"
        if a.page_nbytes != b.page_nbytes:
            return f"region {a.name}: page size {a.page_nbytes} B != {b.page_nbytes} B"
    return None


def check_layout(mine: Sequence[Region], theirs: Sequence[Region], peer: str) -> None:
    why = layout_mismatch(mine, theirs)
    if why:
        raise LayoutError(f"peer {peer!r} has an incompatible KV layout: {why}")


@runtime_checkable
class KVTransport(Protocol):
    """See the module docstring for the contract."""

    @property
    def name(self) -> str: ...

    def descriptor(self) -> dict: ...

    def add_peer(self, desc: dict) -> str: ...

    def write_pages(self, peer: str, src_pages: Sequence[int], dst_pages: Sequence[int], notif: bytes) -> int: ...

    def poll(self, handle: int) -> TransferState: ...

    def error(self, handle: int) -> Optional[str]: ...

    def info(self, handle: int) -> TransferInfo: ...

    def release(self, handle: int) -> None: ...

    def poll_notifs(self) -> list[tuple[str, bytes]]: ...

    def close(self) -> None: ...
