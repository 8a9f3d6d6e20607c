"""Decode side of the hand-off: prealloc queue -> register with prefill -> transfer queue ->
running.

A request reserves pages for its prompt, tells the prefill's bootstrap endpoint where they
are, and waits for the notification that the KV (and the first token) landed. It then decodes
like any other request. Waiting has a deadline, a prefill that stops answering its heartbeat
or comes back as a different process fails its rooms at once, and every failure frees the
reserved pages and tells prefill to drop the room.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from typing import Optional

from dsv4_engine.pd.common import (
    BOOT_ID, HEARTBEAT_INTERVAL_S, HEARTBEAT_MISSES, FaultInjector, PDController, PDState,
)
from dsv4_engine.sequence import Sequence
from dsv4_wire import Paths

log = logging.getLogger("dsv4.pd.decode")


class DecodeController(PDController):
    def __init__(self, engine, args, faults: FaultInjector):
        super().__init__(engine, args, faults, "decode")
        self.url = f"http://{args.host}:{args.port}"
        self.prealloc: deque[Sequence] = deque()
        self.registering: dict[int, Sequence] = {}
        self.transfer: dict[int, Sequence] = {}
        # Per prefill bootstrap address: its boot id, when it last answered, heartbeat in flight.
        self.prefills: dict[str, dict] = {}

    def on_new(self, seq: Sequence) -> None:
        seq.pd.enter(PDState.BOOTSTRAPPING, self._timeout(self.args.bootstrap_timeout))
        self.prealloc.append(seq)

    def busy(self) -> bool:
        return bool(self.prealloc or self.registering or self.transfer)

    def poll(self) -> None:
        now = time.monotonic()
        self._preallocate()
        for peer, msg in self.agent.poll_notifs():
            self._on_notif(msg)
        for seq in list(self.prealloc) + list(self.registering.values()):
            if seq.pd.expired(now):
                self.engine.metrics.inc("num_bootstrap_failed_reqs")
                self._fail(seq, 504, f"bootstrap with prefill {seq.pd.bootstrap_addr} timed out after {self.args.bootstrap_timeout:g}s")
        for seq in list(self.transfer.values()):
            if seq.pd.expired(now):
                self._fail(seq, 504, f"KV from prefill did not arrive within {self.args.waiting_timeout:g}s",
                           "num_transfer_timeout_reqs")
        self._heartbeats(now)

    def _preallocate(self) -> None:
        page_size = self.engine.pool.page_size
        while self.prealloc:
            seq = self.prealloc[0]
            need = -(-len(seq.prompt_ids) // page_size)
            pages = self.engine.pool.allocator.allocate(need)
            if pages is None:
                return  # FCFS: wait for pages; the bootstrap deadline bounds the wait
            self.prealloc.popleft()
            seq.pages = pages
            self.registering[seq.pd.room] = seq
            body = {"room": seq.pd.room, "rid": seq.rid, "desc": self.agent.descriptor(), "dst_pages": pages,
                    "decode_url": self.url, "decode_boot": BOOT_ID}
            self.out.post(seq.pd.bootstrap_addr + Paths.BOOTSTRAP_REGISTER, body,
                          lambda res, err, seq=seq: self._registered(seq, res, err))

    def _registered(self, seq: Sequence, res: Optional[dict], err: Optional[str]) -> None:
        if seq.finished or self.registering.pop(seq.pd.room, None) is None:
            return
        if err is not None:
            self.engine.metrics.inc("num_bootstrap_failed_reqs")
            self._fail(seq, 502, f"cannot register with prefill: {err}")
            return
        seq.pd.peer_boot = res.get("boot_id")
        peer = self.prefills.setdefault(seq.pd.bootstrap_addr, {"boot": seq.pd.peer_boot, "last": time.monotonic(), "busy": False})
        peer["boot"] = seq.pd.peer_boot
        seq.pd.enter(PDState.TRANSFERRING, self._timeout(self.args.waiting_timeout))
        seq.pd.transfer_started = time.monotonic()
        self.transfer[seq.pd.room] = seq
        if self.faults.take("crash"):
            log.error("injected fault: crash while waiting for KV")
            os._exit(17)

    def _on_notif(self, msg: bytes) -> None:
        try:
            note = json.loads(msg)
            room, token = int(note["room"]), int(note["token"])
        except Exception:
            log.warning("ignoring malformed notification %r", msg[:100])
            return
        seq = self.transfer.pop(room, None)
        if seq is None or seq.finished:
            return  # a room we already gave up on
        m = self.engine.metrics
        m.inc("kv_transfers_completed")
        m.inc("kv_transfer_bytes", len(seq.pages) * self.engine.pool.page_nbytes)
        m.observe("kv_transfer_latency_seconds", time.monotonic() - seq.pd.transfer_started)
        seq.pd.state = PDState.SUCCESS
        seq.num_computed = len(seq.prompt_ids)
        self.engine.accept_first_token(seq, token)

    def _heartbeats(self, now: float) -> None:
        """Ask each prefill we wait on whether it is alive and still the same process."""
        waiting_on = {s.pd.bootstrap_addr for s in self.transfer.values()}
        for addr in waiting_on:
            peer = self.prefills.setdefault(addr, {"boot": None, "last": now, "busy": False})
            if self._timeout(1.0) is not None and now - peer["last"] > HEARTBEAT_INTERVAL_S * HEARTBEAT_MISSES:
                self._fail_prefill(addr, f"prefill {addr} stopped answering for {now - peer['last']:.1f}s")
                peer["last"] = now
                continue
            if not peer["busy"] and now - peer.get("asked", 0) >= HEARTBEAT_INTERVAL_S:
                peer["busy"], peer["asked"] = True, now
                self.out.get(f"{addr}{Paths.BOOTSTRAP_HEARTBEAT}?decode_boot={BOOT_ID}",
                             lambda res, err, addr=addr: self._heartbeat_answer(addr, res, err))

    def _heartbeat_answer(self, addr: str, res: Optional[dict], err: Optional[str]) -> None:
        peer = self.prefills[addr]
        peer["busy"] = False
        if err is not None:
            return
        peer["last"] = time.monotonic()
        boot = res.get("boot_id")
        for seq in [s for s in self.transfer.values() if s.pd.bootstrap_addr == addr and s.pd.peer_boot != boot]:
            self._fail(seq, 502, f"prefill {addr} restarted while sending this request's KV", "num_transfer_failed_reqs")

    def _fail_prefill(self, addr: str, msg: str) -> None:
        for seq in [s for s in self.transfer.values() if s.pd.bootstrap_addr == addr]:
            self._fail(seq, 502, msg, "num_transfer_failed_reqs")

    def abort_room(self, room: int, reason: str) -> None:
        """Prefill gave up on this room: the client hears it now, not at our deadline."""
        seq = self.transfer.get(room) or self.registering.get(room)
        if seq is None:
            seq = next((s for s in self.prealloc if s.pd.room == room), None)
        if seq is not None:
            seq.pd.peer_url = "told"  # no echo back
            self._fail(seq, 502, f"prefill failed this request: {reason}", "num_transfer_failed_reqs")

    def on_finish(self, seq: Sequence) -> None:
        pd = seq.pd
        was_waiting = pd.room in self.transfer or pd.room in self.registering or seq in self.prealloc
        self.transfer.pop(pd.room, None)
        self.registering.pop(pd.room, None)
        if seq in self.prealloc:
            self.prealloc.remove(seq)
        if was_waiting and pd.peer_url != "told":
            self.out.post(pd.bootstrap_addr + Paths.BOOTSTRAP_ABORT, {"room": pd.room, "reason": seq.finish_reason or "aborted"})

    def update_gauges(self, m) -> None:
        m.set("num_decode_prealloc_queue_reqs", len(self.prealloc) + len(self.registering))
        m.set("num_decode_transfer_queue_reqs", len(self.transfer))

    def loads(self) -> tuple[dict, dict]:
        return ({"prealloc": len(self.prealloc) + len(self.registering), "transfer": len(self.transfer)},
                {"deadlines": self._timeout(1.0) is not None, "boot_id": BOOT_ID})
