"""KV-page transfer between engines over NIXL: the prefill side WRITEs its KV pages into the
decode side's pages, and a notification tells decode that they have landed.

The pool of an engine is one page-major tensor per paged state (`KVPool.states`), all sharing
page ids, plus one row-major tensor per slot state (`KVPool.slot_states`, DeepSeek-V4's window
ring and compressor stages), all sharing row ids: page ``i`` (row ``i``) of each state is one
contiguous byte range. Every state is registered with NIXL once, and each side is described
once as ONE descriptor list holding every paged region's pages, then every slot region's rows,
back to back (``prep_xfer_dlist``: once for the local pool, once per peer): paged region ``k``'s
page ``p`` is row ``k * num_pages + p``, slot region ``j``'s row ``s`` is row ``P * num_pages +
j * num_slots + s`` (P paged regions). A transfer names the rows of its pages in every paged
region and of its slot row in every slot region in one ``make_prepped_xfer``, so its single
notification means all regions have landed. Host memory (DRAM) and CUDA memory (VRAM) take the
same path.

This is the production `dsv4_engine.pd.transport.KVTransport`; that module states the contract.
Faults are part of the contract. A transfer ends DONE or FAILED, never raises out of ``poll``
and never stays PENDING past its timeout: NIXL raises ``nixlRemoteDisconnectError`` when a peer
dies, which becomes FAILED with the reason kept. A peer that restarts under the same name
comes back through ``add_peer`` with its new descriptor, which drops the old connection and
makes a new one. Bad page indices raise ValueError before anything starts.

Cost on the owner's thread: on host memory UCX copies by CMA (process_vm_writev) inside
``write_pages`` itself, about 10 ms per 32 MiB here, so keep one request's pages per call; with
GPU memory over RDMA or NVLink the call only posts the work and ``poll`` sees it finish.

Threading contract: one owner thread (the engine's scheduler loop) drives the agent. There is
no NIXL progress thread (it would spin a core), so the owner must call ``poll_notifs`` (and
``poll`` for its transfers) regularly: that is also what lets peers' connection setup progress.
Every method takes an internal lock, so a call from another thread (a bootstrap HTTP handler
adding a peer, say) is safe, only serialised.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from dsv4_engine.pd.nixl import compat as nixl_compat
from dsv4_engine.pd.transport import (
    PAGE,
    Layout,
    PoolStates,
    Region,
    TransferInfo,
    TransferState,
    check_layout,
    check_slot_mapping,
    transfer_bytes,
)

log = logging.getLogger(__name__)

DESCRIPTOR_VERSION = 3  # 2: one entry per state region; 3: slot regions, page size, compress rates
DEFAULT_TIMEOUT_S = 60.0  # safety net only; the PD state machines keep tighter deadlines


# ---------------------------------------------------------------------------------------------
# Pure parts: descriptor of a side, per-page descriptor table, page-mapping checks.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerDescriptor:
    """What one side tells the other in the bootstrap handshake (JSON through to_dict)."""

    agent: str
    nixl_metadata: bytes
    num_pages: int
    mem_type: str  # "DRAM" | "VRAM"
    device_id: int
    regions: tuple[Region, ...]  # every state of the pool: paged ones, then slot ones
    base_addrs: tuple[int, ...]  # where each region's page 0 (row 0) is
    num_slots: int = 0  # rows of each slot region (0: the pool has none)
    page_size: int = 0  # tokens per page (0: not stated)

    def to_dict(self) -> dict:
        return {
            "version": DESCRIPTOR_VERSION,
            "agent": self.agent,
            "nixl_metadata": base64.b64encode(self.nixl_metadata).decode("ascii"),
            "num_pages": self.num_pages,
            "num_slots": self.num_slots,
            "page_size": self.page_size,
            "mem_type": self.mem_type,
            "device_id": self.device_id,
            "regions": [{**r.to_dict(), "base_addr": addr} for r, addr in zip(self.regions, self.base_addrs)],
        }

    @classmethod
    def from_dict(cls, d: Any) -> "PeerDescriptor":
        if not isinstance(d, dict):
            raise ValueError(f"peer descriptor must be a dict, got {type(d).__name__}")
        if d.get("version") != DESCRIPTOR_VERSION:
            raise ValueError(f"peer descriptor version {d.get('version')!r} is not {DESCRIPTOR_VERSION}")

        def need(key: str, kind: type, src: dict = d) -> Any:
            if key not in src:
                raise ValueError(f"peer descriptor lacks {key!r}")
            value = src[key]
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"peer descriptor {key!r} must be an integer, got {value!r}")
            if kind is not int and not isinstance(value, kind):
                raise ValueError(f"peer descriptor {key!r} must be {kind.__name__}, got {value!r}")
            return value

        agent = need("agent", str)
        if not agent:
            raise ValueError("peer descriptor has an empty agent name")
        try:
            metadata = base64.b64decode(need("nixl_metadata", str), validate=True)
        except binascii.Error as exc:
            raise ValueError(f"peer descriptor nixl_metadata is not base64: {exc}") from None
        if not metadata:
            raise ValueError("peer descriptor has empty nixl_metadata")
        mem_type = need("mem_type", str)
        if mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"peer descriptor mem_type must be DRAM or VRAM, got {mem_type!r}")
        raw_regions = need("regions", list)
        if not raw_regions:
            raise ValueError("peer descriptor lists no state regions")
        regions = tuple(Region.from_dict(r) for r in raw_regions)
        if len({r.name for r in regions}) != len(regions):
            raise ValueError("peer descriptor names a region twice")
        if [r.kind for r in regions] != sorted((r.kind for r in regions), key=lambda k: k != PAGE):
            raise ValueError("peer descriptor must list its paged regions before its slot regions")
        base_addrs = tuple(need("base_addr", int, r) for r in raw_regions)
        desc = cls(
            agent=agent,
            nixl_metadata=metadata,
            num_pages=need("num_pages", int),
            mem_type=mem_type,
            device_id=need("device_id", int),
            regions=regions,
            base_addrs=base_addrs,
            num_slots=need("num_slots", int),
            page_size=need("page_size", int),
        )
        if min(desc.base_addrs) <= 0 or desc.num_pages <= 0 or desc.device_id < 0:
            raise ValueError("peer descriptor needs base_addr, num_pages > 0 and device_id >= 0")
        has_slots = any(r.kind != PAGE for r in regions)
        if desc.page_size < 0 or desc.num_slots < 0 or has_slots != (desc.num_slots > 0):
            raise ValueError("peer descriptor needs page_size >= 0, and num_slots > 0 exactly when it has slot regions")
        return desc

    @property
    def layout(self) -> Layout:
        return Layout(self.regions, self.page_size)

    def layout_mismatch(self, other: "PeerDescriptor") -> Optional[str]:
        """Why units of `self` cannot be copied byte for byte into units of `other`, or None."""
        return self.layout.mismatch(other.layout)

    def page_table(self) -> np.ndarray:
        """Every region's per-unit rows, back to back: paged regions' pages, then slot regions' rows."""
        return np.concatenate(
            [
                page_table(addr, r.nbytes, self.num_pages if r.kind == PAGE else self.num_slots, self.device_id)
                for r, addr in zip(self.regions, self.base_addrs)
            ]
        )


def transfer_rows(
    pages: np.ndarray, slot: Optional[int], regions: Sequence[Region], num_pages: int, num_slots: int
) -> np.ndarray:
    """The descriptor rows of `pages` in every paged region and of row `slot` in every slot
    region, region by region (the layout of `PeerDescriptor.page_table`)."""
    rows, base = [], 0
    for r in regions:
        if r.kind == PAGE:
            rows.append(pages + base)
            base += num_pages
        else:
            if slot is not None:
                rows.append(np.array([slot + base]))
            base += num_slots
    return np.concatenate(rows).astype(np.int32)


def page_table(base_addr: int, page_nbytes: int, num_pages: int, device_id: int) -> np.ndarray:
    """NIXL's Nx3 descriptor array (address, length, device id): one row per page."""
    table = np.empty((num_pages, 3), dtype=np.uint64)
    table[:, 0] = base_addr + np.arange(num_pages, dtype=np.uint64) * np.uint64(page_nbytes)
    table[:, 1] = page_nbytes
    table[:, 2] = device_id
    return table


def check_page_mapping(
    src_pages: Sequence[int], dst_pages: Sequence[int], num_src_pages: int, num_dst_pages: int
) -> tuple[np.ndarray, np.ndarray]:
    """Validate a src -> dst page mapping; returns both as int32 arrays for NIXL.

    Each destination page may be written once per transfer (two sources for one page would
    race); a source page may be sent to several destinations.
    """
    src = _as_index_array(src_pages, "src_pages")
    dst = _as_index_array(dst_pages, "dst_pages")
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source pages but {len(dst)} destination pages")
    if len(src) == 0:
        raise ValueError("no pages to transfer")
    for name, pages, limit in (("src_pages", src, num_src_pages), ("dst_pages", dst, num_dst_pages)):
        low, high = int(pages.min()), int(pages.max())
        if low < 0 or high >= limit:
            bad = low if low < 0 else high
            raise ValueError(f"{name} has page {bad}, outside [0, {limit})")
    if len(np.unique(dst)) != len(dst):
        raise ValueError("dst_pages names the same page twice")
    return src.astype(np.int32), dst.astype(np.int32)


def _as_index_array(pages: Sequence[int], name: str) -> np.ndarray:
    if isinstance(pages, torch.Tensor):
        pages = pages.detach().cpu().numpy()
    try:
        arr = np.asarray(pages)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} is not a list of page indices: {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a flat list of page indices")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got {arr.dtype}")
    return arr.astype(np.int64)


# ---------------------------------------------------------------------------------------------
# The NIXL shell.
# ---------------------------------------------------------------------------------------------


@dataclass
class _Peer:
    desc: PeerDescriptor
    remote_dlist: Any  # prepped per-page descriptor list of the peer's pool
    disconnected: bool = False  # a transfer saw nixlRemoteDisconnectError


@dataclass
class _Transfer:
    info: TransferInfo
    peer: _Peer  # the incarnation it was started towards
    deadline: Optional[float]
    xfer: Any = None  # nixl_xfer_handle while NIXL holds resources for it
    released: bool = field(default=False)


class KVTransferAgent:
    """One engine's NIXL endpoint for its KV pool. See the module docstring for the contract."""

    def __init__(
        self,
        name: str,
        states: Union[PoolStates, Mapping[str, torch.Tensor], torch.Tensor],
        *,
        default_timeout_s: Optional[float] = DEFAULT_TIMEOUT_S,
    ):
        if not name:
            raise ValueError("agent name must not be empty")
        self._pool = PoolStates.of(states)
        self._layout = self._pool.layout()
        self._regions = list(self._layout.regions)
        self._states = self._pool.tensors()  # paged regions, then slot regions (the descriptor's order)
        tensors = list(self._states.values())
        if len({(t.device.type, t.device.index) for t in tensors}) != 1:
            raise ValueError("every state region must live on the same device")
        self._lock = threading.RLock()
        self._name = name
        self._default_timeout_s = default_timeout_s
        self._mem_type, self._device_id = nixl_compat.mem_type_of(tensors[0])
        self._peers: dict[str, _Peer] = {}
        self._transfers: dict[int, _Transfer] = {}
        self._unreleased: list[Any] = []  # NIXL handles whose release must be retried
        self._ids = itertools.count(1)
        self._closed = False
        self.device_waits = 0  # waits for the pages' writers before a copy (event or whole stream)

        self._agent = nixl_compat.create_agent(name)
        self._registration = self._agent.register_memory(tensors)
        try:
            self._local_dlist = self._agent.prep_xfer_dlist(
                nixl_compat.LOCAL_SIDE,
                self._local_descriptor(with_metadata=False).page_table(),
                self._mem_type,
            )
        except Exception:
            self._agent.deregister_memory(self._registration)
            raise

    # -- identity ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def num_pages(self) -> int:
        return self._pool.num_pages

    @property
    def num_slots(self) -> int:
        return self._pool.num_slots

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page across every paged region."""
        return sum(r.nbytes for r in self._regions if r.kind == PAGE)

    def _local_descriptor(self, with_metadata: bool = True) -> PeerDescriptor:
        return PeerDescriptor(
            agent=self._name,
            nixl_metadata=self._agent.get_agent_metadata() if with_metadata else b"-",
            num_pages=self.num_pages,
            mem_type=self._mem_type,
            device_id=self._device_id,
            regions=tuple(self._regions),
            base_addrs=tuple(t.data_ptr() for t in self._states.values()),
            num_slots=self.num_slots,
            page_size=self._layout.page_size,
        )

    def descriptor(self) -> dict:
        """JSON-serialisable description of this side, for the peer's add_peer."""
        with self._lock:
            self._check_open()
            return self._local_descriptor().to_dict()

    # -- peers ------------------------------------------------------------------------------

    def add_peer(self, desc: dict) -> str:
        """Load a peer so that write_pages and send_notif can reach it; returns its name.

        Idempotent for the same descriptor. A peer seen before with different metadata (it
        restarted), or whose connection broke, is dropped and loaded again; transfers still
        pending towards the old incarnation become FAILED.
        """
        peer_desc = PeerDescriptor.from_dict(desc)
        with self._lock:
            self._check_open()
            if peer_desc.agent == self._name:
                raise ValueError(f"peer has this agent's own name {self._name!r}")
            check_layout(self._layout, peer_desc.layout, peer_desc.agent)
            known = self._peers.get(peer_desc.agent)
            if known is not None:
                if known.desc == peer_desc and not known.disconnected:
                    return peer_desc.agent
                why = "restarted" if known.desc != peer_desc else "reconnecting"
                log.info("peer %s %s: dropping its old connection", peer_desc.agent, why)
                self._drop_peer(peer_desc.agent, f"peer {why}")
            loaded = self._agent.add_remote_agent(peer_desc.nixl_metadata)
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded != peer_desc.agent:
                self._agent.remove_remote_agent(loaded)
                raise ValueError(f"descriptor names agent {peer_desc.agent!r} but its metadata is {loaded!r}")
            try:
                remote_dlist = self._agent.prep_xfer_dlist(loaded, peer_desc.page_table(), peer_desc.mem_type)
            except Exception:
                self._agent.remove_remote_agent(loaded)
                raise
            self._peers[loaded] = _Peer(peer_desc, remote_dlist)
            try:  # start connecting now; it completes as both sides poll
                self._agent.make_connection(loaded)
            except Exception as exc:  # the first transfer connects anyway
                log.debug("make_connection(%s) failed early: %s", loaded, nixl_compat.describe_error(exc))
            return loaded

    def remove_peer(self, name: str) -> None:
        """Forget a peer; its pending transfers become FAILED. Unknown names are ignored."""
        with self._lock:
            self._check_open()
            if name in self._peers:
                self._drop_peer(name, "peer removed")

    def peers(self) -> list[str]:
        with self._lock:
            return sorted(self._peers)

    def _drop_peer(self, name: str, reason: str) -> None:
        peer = self._peers.pop(name)
        # Cancel what is still in flight towards it before its metadata goes away.
        for t in self._transfers.values():
            if t.peer is peer and t.info.state is TransferState.PENDING:
                self._finish(t, TransferState.FAILED, reason)
        try:
            peer.remote_dlist.release()
        except Exception as exc:
            log.warning("releasing descriptors of peer %s failed: %s", name, nixl_compat.describe_error(exc))
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:
            log.warning("remove_remote_agent(%s) failed: %s", name, nixl_compat.describe_error(exc))

    # -- transfers --------------------------------------------------------------------------

    def write_pages(
        self,
        peer: str,
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
        notif: bytes,
        *,
        src_slot: Optional[int] = None,
        dst_slot: Optional[int] = None,
        timeout_s: Optional[float] = None,
        ready: Optional[Any] = None,
    ) -> int:
        """Start a WRITE of local pages src_pages[i] into the peer's pages dst_pages[i], in every
        paged region, and of local row src_slot into the peer's row dst_slot in every slot
        region; the peer receives `notif` (if non-empty) once all of it has landed. Returns a
        handle for poll.

        Raises ValueError for an unknown peer or bad pages, before anything starts. A transfer
        that cannot start (peer gone) returns a handle that is already FAILED. `timeout_s`
        (default: the agent's) bounds how long it may stay PENDING.
        The kernels that wrote the pages must be finished before NIXL reads them: `ready` (an
        event recorded after them, `transport.pages_ready`) is waited for when given; else, on
        CUDA, the whole current stream. Each wait counts in `device_waits`.
        """
        if not isinstance(notif, (bytes, bytearray)):
            raise ValueError(f"notif must be bytes, got {type(notif).__name__}")
        with self._lock:
            self._check_open()
            target = self._peers.get(peer)
            if target is None:
                raise ValueError(f"unknown peer {peer!r}: add_peer it first")
            src, dst = check_page_mapping(src_pages, dst_pages, self.num_pages, target.desc.num_pages)
            check_slot_mapping(src_slot, dst_slot, self.num_slots, target.desc.num_slots)
            by_state = transfer_bytes(self._regions, len(src), src_slot is not None)
            first = next(iter(self._states.values()))
            if ready is not None:
                ready.synchronize()
                self.device_waits += 1
            elif first.is_cuda:
                torch.cuda.current_stream(first.device).synchronize()
                self.device_waits += 1
            timeout = self._default_timeout_s if timeout_s is None else timeout_s
            now = time.monotonic()
            handle = next(self._ids)
            t = _Transfer(
                info=TransferInfo(
                    handle=handle,
                    peer=peer,
                    num_pages=len(src),
                    nbytes=sum(by_state.values()),
                    state=TransferState.PENDING,
                    error=None,
                    started_at=now,
                    finished_at=None,
                    nbytes_by_state=by_state,
                ),
                peer=target,
                deadline=None if timeout is None else now + timeout,
            )
            self._transfers[handle] = t
            try:
                t.xfer = self._agent.make_prepped_xfer(
                    "WRITE",
                    self._local_dlist,
                    transfer_rows(src, src_slot, self._regions, self.num_pages, self.num_slots),
                    target.remote_dlist,
                    transfer_rows(dst, dst_slot, self._regions, target.desc.num_pages, target.desc.num_slots),
                    bytes(notif),
                )
                self._apply_status(t, self._agent.transfer(t.xfer))
            except Exception as exc:
                self._fail_on_exception(t, exc)
            return handle

    def poll(self, handle: int) -> TransferState:
        """Advance NIXL and return the transfer's state; never raises for transfer faults
        (KeyError only for a handle that was never issued or is already released)."""
        with self._lock:
            t = self._transfers[handle]
            if t.info.state is TransferState.PENDING and not self._closed:
                try:
                    self._apply_status(t, self._agent.check_xfer_state(t.xfer))
                except Exception as exc:
                    self._fail_on_exception(t, exc)
                if t.info.state is TransferState.PENDING and t.deadline is not None and time.monotonic() >= t.deadline:
                    limit = t.deadline - t.info.started_at
                    self._finish(t, TransferState.FAILED, f"timed out: still pending after {limit:.3g} s")
            return t.info.state

    def error(self, handle: int) -> Optional[str]:
        with self._lock:
            return self._transfers[handle].info.error

    def info(self, handle: int) -> TransferInfo:
        """A snapshot (copy) of the transfer's record."""
        with self._lock:
            i = self._transfers[handle].info
            return TransferInfo(**{**i.__dict__, "nbytes_by_state": dict(i.nbytes_by_state)})

    def release(self, handle: int) -> None:
        """Forget a transfer. Releasing a PENDING one cancels it as far as NIXL can; the peer
        then may or may not have the data, so tell it (send_notif) what to expect."""
        with self._lock:
            t = self._transfers.pop(handle, None)
            if t is not None:
                self._release_xfer(t)

    def _apply_status(self, t: _Transfer, status: str) -> None:
        if status == "DONE":
            self._finish(t, TransferState.DONE, None)
        elif status == "ERR":
            self._finish(t, TransferState.FAILED, "NIXL reported ERR")

    def _fail_on_exception(self, t: _Transfer, exc: Exception) -> None:
        if nixl_compat.is_remote_disconnect(exc):
            t.peer.disconnected = True
        self._finish(t, TransferState.FAILED, nixl_compat.describe_error(exc))

    def _finish(self, t: _Transfer, state: TransferState, error: Optional[str]) -> None:
        t.info.state = state
        t.info.error = error
        t.info.finished_at = time.monotonic()
        if state is TransferState.FAILED:
            log.warning("KV transfer %d to %s failed: %s", t.info.handle, t.info.peer, error)
            # Give NIXL's resources back now; a failed request must not pin anything.
            self._release_xfer(t)

    def _release_xfer(self, t: _Transfer) -> None:
        if t.xfer is None or t.released:
            return
        t.released = True
        try:
            t.xfer.release()
        except Exception as exc:  # still active and not cancellable: retried in poll_notifs
            log.debug("release of transfer %d deferred: %s", t.info.handle, nixl_compat.describe_error(exc))
            self._unreleased.append(t.xfer)

    def _retry_releases(self) -> None:
        pending, self._unreleased = self._unreleased, []
        for xfer in pending:
            try:
                xfer.release()
            except Exception:
                self._unreleased.append(xfer)

    # -- notifications ----------------------------------------------------------------------

    def send_notif(self, peer: str, msg: bytes) -> bool:
        """Send a standalone message to a peer (abort, heartbeat...). Returns False when NIXL
        could not send it (peer gone); ValueError for an unknown peer."""
        if not isinstance(msg, (bytes, bytearray)) or not msg:
            raise ValueError("msg must be non-empty bytes")
        with self._lock:
            self._check_open()
            target = self._peers.get(peer)
            if target is None:
                raise ValueError(f"unknown peer {peer!r}: add_peer it first")
            try:
                self._agent.send_notif(peer, bytes(msg))
                return True
            except Exception as exc:
                if nixl_compat.is_remote_disconnect(exc):
                    target.disconnected = True
                log.warning("notification to %s failed: %s", peer, nixl_compat.describe_error(exc))
                return False

    def poll_notifs(self) -> list[tuple[str, bytes]]:
        """Messages that arrived since the last call, as (peer name, message), in arrival
        order per peer. Call it regularly: it also drives NIXL's progress (connection setup
        for peers that write to us)."""
        with self._lock:
            if self._closed:
                return []
            if self._unreleased:
                self._retry_releases()
            try:
                new = self._agent.get_new_notifs()
            except Exception as exc:
                log.warning("reading NIXL notifications failed: %s", nixl_compat.describe_error(exc))
                return []
            out: list[tuple[str, bytes]] = []
            for sender, messages in new.items():
                name = sender.decode() if isinstance(sender, bytes) else str(sender)
                out.extend((name, bytes(m)) for m in messages)
            return out

    # -- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Cancel what is in flight, drop peers, deregister the pool. Idempotent."""
        with self._lock:
            if self._closed:
                return
            for t in list(self._transfers.values()):
                if t.info.state is TransferState.PENDING:
                    self._finish(t, TransferState.FAILED, "agent closed")
                self._release_xfer(t)
            for name in list(self._peers):
                self._drop_peer(name, "agent closed")
            self._retry_releases()
            for step in (self._local_dlist.release, lambda: self._agent.deregister_memory(self._registration)):
                try:
                    step()
                except Exception as exc:
                    log.warning("closing NIXL agent %s: %s", self._name, nixl_compat.describe_error(exc))
            self._closed = True
            self._agent = None

    def __enter__(self) -> "KVTransferAgent":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"KV transfer agent {self._name!r} is closed")
