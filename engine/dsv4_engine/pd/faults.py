"""Fault injection for PD, applied at the seams rather than inside the state machines.

Faults are armed over /admin/faults (names below; docs/engine.md documents them). Each affects `count`
uses (-1: until cleared):
- stall_transfer, fail_transfer, drop_notification: the next KV transfer never finishes, fails
  at once, or lands without telling decode (`FaultyTransport`); with `rank` (a decode over
  several TP ranks) only the write into that rank's pool;
- crash: the process exits (status 17) with a transfer in flight (prefill: right after
  starting it; decode: right after its room is registered, while it waits for the KV);
- delay_bootstrap: a registration is accepted but applied `seconds` later (default 5);
- corrupt_transfer: the next transfer sends one flipped byte in one region (`state`, default
  the first paged region, in the request's last page; a slot state such as `swa_kv` names its
  row), restored on the sender once the transfer ends; with --transfer-checksum decode must
  catch it;
- disable_deadlines: the controllers' `Deadlines` policy turns every deadline off (the
  production wedge, reproduced on purpose);
- stall_long_context: a step hangs when it would generate for a request whose context (prompt
  + output) has passed `tokens` tokens (default 1024), for `seconds` (default: until cleared) —
  the rollout incident: a short fixed-prompt benchmark passes, a growing conversation wedges
  the engine's loop. It lives in the engine's step (`Engine.step`), not at a PD seam.

`--arm-fault NAME[:key=value,...]` (repeatable, with --enable-fault-injection) arms faults at
start, so a changed set of engine flags can carry one (`parse_arm_fault`).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from typing import Any, Callable, Optional, Sequence

from dsv4_engine.pd.channel import ControlChannel, Done
import torch

from dsv4_engine.pd.fault_names import FAULTS, STALL_DEFAULT_TOKENS
from dsv4_engine.pd.messages import RegisterRoom, TransferNote
from dsv4_engine.pd.transport import KVTransport, PoolStates, TransferInfo, TransferState, slot_args

log = logging.getLogger("dsv4.pd.faults")

CRASH_STATUS = 17


class FaultInjector:
    """Faults armed over /admin/faults: each affects `count` requests (-1: until cleared)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: dict[str, dict[str, Any]] = {}
        self._clears = 0  # bumped by clear(): a stall in progress ends when it changes

    def arm(self, name: str, count: int, **params: Any) -> None:
        if name not in FAULTS:
            raise ValueError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
        if count == 0 or count < -1:
            raise ValueError("count must be a positive number of requests or -1 (until cleared)")
        with self._lock:
            self._armed[name] = {"count": count, **params}

    def clear(self) -> None:
        with self._lock:
            self._armed.clear()
            self._clears += 1

    def long_context_stall(self, contexts: Sequence[int]) -> Optional[dict[str, Any]]:
        """stall_long_context: its parameters (one use taken) when one of `contexts` (the
        context lengths of the requests a step generates for) has passed its `tokens`; else None."""
        with self._lock:
            f = self._armed.get("stall_long_context")
            if f is None or not any(c > int(f.get("tokens", STALL_DEFAULT_TOKENS)) for c in contexts):
                return None
        return self.take("stall_long_context")

    def hang(self, seconds: Optional[float], poll_s: float = 0.05, sleep: Callable[[float], Any] = time.sleep) -> float:
        """Block the caller for `seconds` (None: forever) or until clear(); the seconds it hung."""
        with self._lock:
            clears = self._clears
        started = time.monotonic()
        while seconds is None or time.monotonic() - started < seconds:
            with self._lock:
                if self._clears != clears:
                    break
            sleep(poll_s)
        return time.monotonic() - started

    def active(self, name: str) -> bool:
        with self._lock:
            return name in self._armed

    def take(self, name: str, rank: Optional[int] = None) -> Optional[dict[str, Any]]:
        """Consume one use of a fault; its parameters, or None when it is not armed. A transfer
        fault armed with `rank` hits only the write to that decode rank (`rank`: this write's)."""
        with self._lock:
            f = self._armed.get(name)
            if f is None or (rank is not None and f.get("rank", rank) != rank):
                return None
            if f["count"] > 0:
                f["count"] -= 1
                if f["count"] == 0:
                    del self._armed[name]
            return dict(f)

    def bootstrap_delay(self) -> float:
        """Seconds to hold back a registration being accepted now (delay_bootstrap)."""
        f = self.take("delay_bootstrap")
        return float(f.get("seconds", 5.0)) if f else 0.0

    def snapshot(self) -> dict:
        with self._lock:
            return {k: dict(v) for k, v in self._armed.items()}


class Deadlines:
    """Whether the controllers keep deadlines: `--deadlines` and not disable_deadlines."""

    def __init__(self, enabled: bool = True, faults: Optional[FaultInjector] = None):
        self.enabled = enabled
        self.faults = faults

    @property
    def on(self) -> bool:
        return self.enabled and not (self.faults is not None and self.faults.active("disable_deadlines"))

    def timeout(self, seconds: float) -> Optional[float]:
        """`seconds`, or None (no deadline) while deadlines are off."""
        return seconds if self.on else None


def note_rank(notif: bytes) -> int:
    """The decode rank a write's notification names (0 when it names none or is no note)."""
    try:
        return TransferNote.decode(notif).rank if notif else 0
    except ValueError:
        return 0


class FaultyTransport:
    """A KVTransport that applies armed transfer faults, then defers to the real one. `states`
    (the sender's pool) is what corrupt_transfer flips a byte of."""

    def __init__(
        self,
        inner: KVTransport,
        faults: FaultInjector,
        exit_fn: Callable[[int], Any] = os._exit,
        states: Optional[PoolStates] = None,
    ):
        self.inner = inner
        self.faults = faults
        self._exit = exit_fn
        self._states = states
        self._ids = itertools.count(1)
        self._handles: dict[int, int] = {}  # ours -> inner's
        self._injected: dict[int, TransferInfo] = {}  # stalled or failed here, never started
        self._restore: dict[int, Callable[[], None]] = {}  # corrupted sources to put back once it ends

    @property
    def name(self) -> str:
        return self.inner.name

    def descriptor(self) -> dict:
        return self.inner.descriptor()

    def add_peer(self, desc: dict) -> str:
        return self.inner.add_peer(desc)

    def write_pages(
        self,
        peer: str,
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
        notif: bytes,
        *,
        src_slot: Optional[int] = None,
        dst_slot: Optional[int] = None,
        **ready: Any,
    ) -> int:
        handle = next(self._ids)
        rank = note_rank(notif)
        for fault, state in (("stall_transfer", TransferState.PENDING), ("fail_transfer", TransferState.FAILED)):
            if self.faults.take(fault, rank):  # stalled: never started, never failed (the production wedge)
                error = f"injected fault {fault}" if state is TransferState.FAILED else None
                now = time.monotonic()
                self._injected[handle] = TransferInfo(
                    handle, peer, len(src_pages), 0, state, error, now, None if state is TransferState.PENDING else now
                )
                return handle
        if self.faults.take("drop_notification", rank):
            notif = b""  # the data lands but decode is never told: its deadline must catch it
        corrupt = self.faults.take("corrupt_transfer")
        if corrupt:
            self._restore[handle] = self._flip_byte(corrupt.get("state"), src_pages, src_slot)
        try:
            self._handles[handle] = self.inner.write_pages(
                peer, src_pages, dst_pages, notif, **slot_args(src_slot, dst_slot), **ready
            )
        except Exception:
            self._put_back(handle)
            raise
        if self.faults.take("crash"):
            log.error("injected fault: crash with a transfer in flight")
            self._exit(CRASH_STATUS)
        return handle

    def poll(self, handle: int) -> TransferState:
        if handle in self._injected:
            return self._injected[handle].state
        state = self.inner.poll(self._handles[handle])
        if state is not TransferState.PENDING:
            self._put_back(handle)
        return state

    def error(self, handle: int) -> Optional[str]:
        if handle in self._injected:
            return self._injected[handle].error
        return self.inner.error(self._handles[handle])

    def info(self, handle: int) -> TransferInfo:
        if handle in self._injected:
            return self._injected[handle]
        info = self.inner.info(self._handles[handle])
        info.handle = handle
        return info

    def release(self, handle: int) -> None:
        if self._injected.pop(handle, None) is None and handle in self._handles:
            self.inner.release(self._handles.pop(handle))
        self._put_back(handle)

    def poll_notifs(self) -> list[tuple[str, bytes]]:
        return self.inner.poll_notifs()

    def close(self) -> None:
        self.inner.close()
        for handle in list(self._restore):
            self._put_back(handle)

    # -- corrupt_transfer ---------------------------------------------------------------------

    def _flip_byte(self, state: Optional[str], src_pages: Sequence[int], src_slot: Optional[int]) -> Callable[[], None]:
        """Flip one byte of what this transfer sends; returns how to put it back."""
        if self._states is None:
            raise ValueError("corrupt_transfer needs the sender's pool states")
        name = state or next(iter(self._states.pages))
        if name in self._states.pages:
            # The request's last page: it holds the last prompt token, which the request always
            # computes itself, so unless the prompt ends exactly on a page boundary it is a
            # partial page, never cached nor shared. The first pages are often prefix-cache
            # pages that other requests read (and send to their decodes) while the byte is flipped.
            unit = self._states.pages[name][int(src_pages[-1])]
        elif name in self._states.slots and src_slot is not None:
            unit = self._states.slots[name][src_slot]
        else:
            known = [*self._states.pages, *self._states.slots]
            raise ValueError(f"corrupt_transfer: state {name!r} is not sent by this transfer (states: {known})")
        b = unit.view(-1).view(torch.uint8)
        at = slice(b.numel() // 2, b.numel() // 2 + 1)
        old = b[at].clone()
        b[at] = old ^ 0xA5
        log.error("injected fault: corrupt_transfer flipped a byte of state %s", name)
        return lambda: b[at].copy_(old)

    def _put_back(self, handle: int) -> None:
        restore = self._restore.pop(handle, None)
        if restore is not None:
            restore()


class FaultyChannel:
    """A ControlChannel that applies the decode side's crash fault: exit once a room is
    registered and the KV is on its way."""

    def __init__(self, inner: ControlChannel, faults: FaultInjector, exit_fn: Callable[[int], Any] = os._exit):
        self.inner = inner
        self.faults = faults
        self._exit = exit_fn

    def register(self, bootstrap_addr: str, msg: RegisterRoom, done: Done) -> None:
        def registered(result: Optional[dict], error: Optional[str]) -> None:
            done(result, error)
            if error is None and self.faults.take("crash"):
                log.error("injected fault: crash while waiting for KV")
                self._exit(CRASH_STATUS)

        self.inner.register(bootstrap_addr, msg, registered)

    def heartbeat(self, bootstrap_addr: str, decode_boot: str, done: Done) -> None:
        self.inner.heartbeat(bootstrap_addr, decode_boot, done)

    def abort_prefill(self, bootstrap_addr: str, room: int, reason: str) -> None:
        self.inner.abort_prefill(bootstrap_addr, room, reason)

    def abort_decode(self, decode_url: str, room: int, reason: str) -> None:
        self.inner.abort_decode(decode_url, room, reason)

    def close(self) -> None:
        self.inner.close()
