"""PD in one process: a `FakeFabric` links fake transports (by name) and fake control channels
(by address), so real prefill and decode controllers over real engines talk without NIXL,
HTTP or threads. It keeps the seams' contracts (`transport`, `channel`) and can, on command,
stall a transfer, fail it, drop its notification, or make a peer die.

A write copies every state region at once (the pages of each paged region and the slot row of
each slot region); its notification is queued for the peer. A dead
peer neither receives nor sends: transfers to it (pending ones too) end FAILED with a
disconnect error, control calls to it fail as unreachable, and its own notifications stop.
Every control message is recorded in `fabric.sent`, for tests to count who told whom.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from dsv4_engine.pd.channel import Deliver, Done
from dsv4_engine.pd.messages import RegisterRoom, registration_answer
from dsv4_engine.pd.nixl.agent import check_page_mapping
from dsv4_engine.pd.transport import (
    Layout,
    PoolStates,
    Region,
    TransferInfo,
    TransferState,
    check_layout,
    check_slot_mapping,
    transfer_bytes,
)

DISCONNECT = "remote disconnect: peer {} is gone"


@dataclass
class _Xfer:
    info: TransferInfo
    apply: Callable[[], None]  # copy the pages and queue the notification


@dataclass
class _Endpoint:
    """What a controller serves at an address (the production pd_routes, in process)."""

    controller: Any
    role: str


@dataclass
class FakeFabric:
    transports: dict[str, "FakeTransport"] = field(default_factory=dict)
    endpoints: dict[str, _Endpoint] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)
    sent: list[tuple[str, str, Any]] = field(default_factory=list)  # (kind, address, room or body)

    def transport(self, name: str, states: Union[PoolStates, Mapping[str, torch.Tensor]]) -> "FakeTransport":
        t = FakeTransport(self, name, states)
        self.transports[name] = t
        return t

    def channel(self, deliver: Deliver) -> "FakeChannel":
        return FakeChannel(self, deliver)

    def serve(self, address: str, controller: Any, role: str) -> None:
        """Make `controller` reachable at `address`: a prefill's bootstrap address, or a
        decode's URL."""
        self.endpoints[address] = _Endpoint(controller, role)

    def die(self, *names: str) -> None:
        """Transport names and/or addresses that stop answering from now on."""
        self.dead.update(names)
        for name in names:
            for t in self.transports.values():
                t._peer_died(name)

    def aborts_to(self, address: str, room: int) -> int:
        return sum(1 for kind, addr, what in self.sent if kind == "abort" and addr == address and what == room)


class FakeTransport:
    """A KVTransport over in-process pools (see the module docstring)."""

    def __init__(self, fabric: FakeFabric, name: str, states: Union[PoolStates, Mapping[str, torch.Tensor]]):
        self.fabric = fabric
        self._name = name
        self._pool = PoolStates.of(states)
        self._layout = self._pool.layout()
        self._regions: list[Region] = list(self._layout.regions)
        self._num_pages = self._pool.num_pages
        self._num_slots = self._pool.num_slots
        self._peers: set[str] = set()
        self._xfers: dict[int, _Xfer] = {}
        self._ids = itertools.count(1)
        self._inbox: deque[tuple[str, bytes]] = deque()
        self._closed = False
        self._stall = 0
        self._fail: list[str] = []
        self._drop = 0

    # -- commands -----------------------------------------------------------------------------

    def stall_next(self, n: int = 1) -> None:
        """The next n writes stay PENDING until `finish_stalled` (or the peer dies)."""
        self._stall += n

    def fail_next(self, reason: str = "injected transport failure") -> None:
        self._fail.append(reason)

    def drop_next_notification(self, n: int = 1) -> None:
        """The next n writes land without their notification."""
        self._drop += n

    def finish_stalled(self) -> None:
        for x in self._xfers.values():
            if x.info.state is TransferState.PENDING:
                self._complete(x)

    # -- KVTransport ----------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    def descriptor(self) -> dict:
        return {
            "agent": self._name,
            "num_pages": self._num_pages,
            "num_slots": self._num_slots,
            "page_size": self._layout.page_size,
            "regions": [r.to_dict() for r in self._regions],
        }

    def add_peer(self, desc: dict) -> str:
        name = desc["agent"]
        if name not in self.fabric.transports:
            raise ValueError(f"no fake transport named {name!r} on this fabric")
        check_layout(
            self._layout, Layout(tuple(Region.from_dict(r) for r in desc["regions"]), desc.get("page_size", 0)), name
        )
        self._peers.add(name)
        return name

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
    ) -> int:
        if self._closed:
            raise RuntimeError(f"fake transport {self._name!r} is closed")
        if peer not in self._peers:
            raise ValueError(f"unknown peer {peer!r}: add_peer it first")
        target = self.fabric.transports[peer]
        src, dst = check_page_mapping(src_pages, dst_pages, self._num_pages, target._num_pages)
        check_slot_mapping(src_slot, dst_slot, self._num_slots, target._num_slots)
        handle = next(self._ids)
        by_state = transfer_bytes(self._regions, len(src), src_slot is not None)
        info = TransferInfo(
            handle,
            peer,
            len(src),
            sum(by_state.values()),
            TransferState.PENDING,
            None,
            time.monotonic(),
            None,
            by_state,
        )
        drop = self._drop > 0
        self._drop -= drop

        def apply() -> None:
            s, d = torch.as_tensor(src, dtype=torch.long), torch.as_tensor(dst, dtype=torch.long)
            for name, t in self._pool.pages.items():
                target._pool.pages[name][d] = t[s].to(target._pool.pages[name].device)
            for name, t in self._pool.slots.items():
                target._pool.slots[name][dst_slot] = t[src_slot].to(target._pool.slots[name].device)
            if notif and not drop:
                target._inbox.append((self._name, bytes(notif)))

        x = _Xfer(info, apply)
        self._xfers[handle] = x
        if peer in self.fabric.dead or self._name in self.fabric.dead:
            self._end(x, TransferState.FAILED, DISCONNECT.format(peer))
        elif self._fail:
            self._end(x, TransferState.FAILED, self._fail.pop(0))
        elif self._stall > 0:
            self._stall -= 1
        else:
            self._complete(x)
        return handle

    def poll(self, handle: int) -> TransferState:
        return self._xfers[handle].info.state

    def error(self, handle: int) -> Optional[str]:
        return self._xfers[handle].info.error

    def info(self, handle: int) -> TransferInfo:
        i = self._xfers[handle].info
        return TransferInfo(**{**i.__dict__, "nbytes_by_state": dict(i.nbytes_by_state)})

    def release(self, handle: int) -> None:
        self._xfers.pop(handle, None)

    def send_notif(self, peer: str, msg: bytes) -> bool:
        """A standalone message to a peer (as the NIXL agent's); False when the peer is gone."""
        if peer not in self._peers:
            raise ValueError(f"unknown peer {peer!r}: add_peer it first")
        if peer in self.fabric.dead:
            return False
        self.fabric.transports[peer]._inbox.append((self._name, bytes(msg)))
        return True

    def poll_notifs(self) -> list[tuple[str, bytes]]:
        if self._closed or self._name in self.fabric.dead:
            return []
        out = list(self._inbox)
        self._inbox.clear()
        return out

    def close(self) -> None:
        for x in self._xfers.values():
            if x.info.state is TransferState.PENDING:
                self._end(x, TransferState.FAILED, "transport closed")
        self._closed = True

    # -- inside -----------------------------------------------------------------------------------

    def _complete(self, x: _Xfer) -> None:
        x.apply()
        self._end(x, TransferState.DONE, None)

    @staticmethod
    def _end(x: _Xfer, state: TransferState, error: Optional[str]) -> None:
        x.info.state, x.info.error, x.info.finished_at = state, error, time.monotonic()

    def _peer_died(self, name: str) -> None:
        for x in self._xfers.values():
            if x.info.state is TransferState.PENDING and (x.info.peer == name or self._name == name):
                self._end(x, TransferState.FAILED, DISCONNECT.format(x.info.peer))


class FakeChannel:
    """A ControlChannel to controllers served on the fabric. The peer handles a message at once
    (as its HTTP endpoint would, on another thread); the answer comes back through `deliver`,
    i.e. on the caller's next engine step, like the HTTP channel's."""

    def __init__(self, fabric: FakeFabric, deliver: Deliver):
        self.fabric = fabric
        self._deliver = deliver
        self.closed = False

    def _reach(self, address: str, role: str) -> Optional[_Endpoint]:
        ep = self.fabric.endpoints.get(address)
        if self.closed or ep is None or address in self.fabric.dead or ep.role != role:
            return None
        return ep

    def _answer(self, done: Done, result: Optional[dict], error: Optional[str]) -> None:
        self._deliver(lambda: done(result, error))

    def register(self, bootstrap_addr: str, msg: RegisterRoom, done: Done) -> None:
        self.fabric.sent.append(("register", bootstrap_addr, msg.room))
        ep = self._reach(bootstrap_addr, "prefill")
        if ep is None:
            return self._answer(done, None, f"POST {bootstrap_addr}: connection refused")
        try:
            ep.controller.register(RegisterRoom.of(msg.wire()))  # through its wire form, as over HTTP
        except ValueError as e:
            return self._answer(done, None, f"POST {bootstrap_addr} -> 400: bad registration: {e}")
        self._answer(done, registration_answer(ep.controller.boot_id), None)

    def heartbeat(self, bootstrap_addr: str, decode_boot: str, done: Done) -> None:
        self.fabric.sent.append(("heartbeat", bootstrap_addr, decode_boot))
        ep = self._reach(bootstrap_addr, "prefill")
        if ep is None:
            return self._answer(done, None, f"GET {bootstrap_addr}: connection refused")
        ep.controller.heartbeat(decode_boot)
        self._answer(done, {"boot_id": ep.controller.boot_id}, None)

    def _abort(self, address: str, role: str, room: int, reason: str) -> None:
        self.fabric.sent.append(("abort", address, room))
        ep = self._reach(address, role)
        if ep is not None:  # the engine thread of the peer handles it, as pd_routes arranges
            ctl = ep.controller
            ctl.engine.call(lambda: ctl.abort_room(room, reason))

    def abort_prefill(self, bootstrap_addr: str, room: int, reason: str) -> None:
        self._abort(bootstrap_addr, "prefill", room, reason)

    def abort_decode(self, decode_url: str, room: int, reason: str) -> None:
        self._abort(decode_url, "decode", room, reason)

    def close(self) -> None:
        self.closed = True
