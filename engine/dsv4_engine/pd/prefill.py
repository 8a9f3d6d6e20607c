"""Prefill side of the hand-off: bootstrap queue -> forward -> inflight queue -> done.

A request waits in the bootstrap queue until its decode peer registers the pages it reserved,
is prefilled like any other request, then sits in the inflight queue while its KV pages are
written into the decode's pages over NIXL. Every one of those states has a deadline, a failed
or timed-out transfer frees the pages and tells decode, and a decode that stops answering its
heartbeat (died, restarted) fails its rooms at once instead of at the deadline.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import time
from dataclasses import dataclass

from dsv4_engine.pd.common import (
    BOOT_ID, HEARTBEAT_INTERVAL_S, HEARTBEAT_MISSES, FaultInjector, PDController, PDState,
)
from dsv4_engine.pd.nixl.agent import TransferState
from dsv4_engine.sequence import Sequence
from dsv4_wire import Paths

log = logging.getLogger("dsv4.pd.prefill")
PENDING_REGISTRATION_TTL_S = 60.0


@dataclass
class Registration:
    """What a decode tells us about one room: where to write and how to reach it."""

    room: int
    desc: dict
    dst_pages: list[int]
    decode_url: str
    decode_boot: str
    received: float
    apply_at: float


class PrefillController(PDController):
    def __init__(self, engine, args, faults: FaultInjector):
        super().__init__(engine, args, faults, "prefill")
        self.bootstrap: dict[int, Sequence] = {}
        self.inflight: dict[int, Sequence] = {}
        self.registrations: "queue.Queue[Registration]" = queue.Queue()  # filled by the bootstrap server
        self.pending: dict[int, Registration] = {}  # registered before the request reached us
        self.decode_heartbeats: dict[str, float] = {}  # decode boot id -> last time we heard from it

    # ---- called from the bootstrap HTTP thread ---------------------------------------------------

    def register(self, body: dict) -> None:
        now = time.monotonic()
        delay = self.faults.take("delay_bootstrap")
        reg = Registration(
            room=int(body["room"]), desc=body["desc"], dst_pages=[int(p) for p in body["dst_pages"]],
            decode_url=str(body["decode_url"]), decode_boot=str(body["decode_boot"]), received=now,
            apply_at=now + (float(delay.get("seconds", 5.0)) if delay else 0.0),
        )
        self.heartbeat(reg.decode_boot)
        self.registrations.put(reg)

    def heartbeat(self, decode_boot: str) -> None:
        self.decode_heartbeats[decode_boot] = time.monotonic()

    # ---- engine-thread hooks ---------------------------------------------------------------------

    def on_new(self, seq: Sequence) -> None:
        seq.pd.enter(PDState.BOOTSTRAPPING, self._timeout(self.args.bootstrap_timeout))
        self.bootstrap[seq.pd.room] = seq
        reg = self.pending.pop(seq.pd.room, None)
        if reg is not None:
            self.registrations.put(reg)

    def busy(self) -> bool:
        return bool(self.bootstrap or self.inflight or not self.registrations.empty())

    def poll(self) -> None:
        now = time.monotonic()
        self._take_registrations(now)
        self.agent.poll_notifs()  # lets NIXL connection setup progress (no progress thread)
        for room, seq in list(self.inflight.items()):
            self._poll_transfer(seq, now)
        for seq in list(self.bootstrap.values()):
            if seq.pd.expired(now):
                self.engine.metrics.inc("num_bootstrap_failed_reqs")
                self._fail(seq, 504, f"bootstrap timed out after {self.args.bootstrap_timeout:g}s: no decode peer registered room {seq.pd.room}")
        self._check_decode_liveness(now)
        for room, reg in list(self.pending.items()):
            if now - reg.received > PENDING_REGISTRATION_TTL_S:
                del self.pending[room]

    def _take_registrations(self, now: float) -> None:
        deferred = []
        while True:
            try:
                reg = self.registrations.get_nowait()
            except queue.Empty:
                break
            if reg.apply_at > now:
                deferred.append(reg)
                continue
            seq = self.bootstrap.get(reg.room)
            if seq is None:
                self.pending[reg.room] = reg
                continue
            self._apply_registration(seq, reg)
        for reg in deferred:
            self.registrations.put(reg)

    def _apply_registration(self, seq: Sequence, reg: Registration) -> None:
        need = -(-len(seq.prompt_ids) // self.engine.pool.page_size)
        if len(reg.dst_pages) < need:
            self.engine.metrics.inc("num_bootstrap_failed_reqs")
            self._fail(seq, 500, f"decode reserved {len(reg.dst_pages)} pages, prompt needs {need}")
            return
        try:
            seq.pd.peer = self.agent.add_peer(reg.desc)
        except Exception as e:
            self.engine.metrics.inc("num_bootstrap_failed_reqs")
            self._fail(seq, 502, f"cannot connect to decode peer: {e}")
            return
        del self.bootstrap[seq.pd.room]
        seq.pd.dst_pages = reg.dst_pages[:need]
        seq.pd.peer_url = reg.decode_url
        seq.pd.peer_boot = reg.decode_boot
        seq.pd.enter(PDState.WAITING_FOR_INPUT, None)  # now an ordinary prefill in the scheduler
        self.engine.scheduler.add(seq)

    def on_prefill_done(self, seq: Sequence) -> None:
        """First token sampled: KV pages go to decode, with the token in the notification."""
        self.engine.scheduler.remove(seq)
        pd = seq.pd
        pd.enter(PDState.TRANSFERRING, self._timeout(self.args.transfer_timeout))
        pd.transfer_started = time.monotonic()
        self.inflight[pd.room] = seq
        n = len(pd.dst_pages)
        notif = json.dumps({"room": pd.room, "token": seq.output_ids[-1], "prefill_boot": BOOT_ID}).encode()
        if self.faults.take("stall_transfer"):
            pd.stalled = True  # never started, never failed: the production wedge
            return
        if self.faults.take("fail_transfer"):
            self._fail(seq, 502, "KV transfer failed: injected fault fail_transfer", "num_transfer_failed_reqs")
            return
        if self.faults.take("drop_notification"):
            notif = b""  # the data lands but decode is never told: its deadline must catch it
        try:
            pd.handle = self.agent.write_pages(pd.peer, seq.pages[:n], pd.dst_pages, notif)
        except Exception as e:
            self._fail(seq, 502, f"KV transfer could not start: {e}", "num_transfer_failed_reqs")
            return
        if self.faults.take("crash"):
            log.error("injected fault: crash with a transfer in flight")
            os._exit(17)

    def _poll_transfer(self, seq: Sequence, now: float) -> None:
        pd = seq.pd
        if pd.handle is not None:
            state = self.agent.poll(pd.handle)
            if state is TransferState.DONE:
                info = self.agent.info(pd.handle)
                m = self.engine.metrics
                m.inc("kv_transfers_completed")
                m.inc("kv_transfer_bytes", info.nbytes)
                m.observe("kv_transfer_latency_seconds", now - pd.transfer_started)
                pd.state = PDState.SUCCESS
                self.engine.finish(seq, "stop")
                return
            if state is TransferState.FAILED:
                self._fail(seq, 502, f"KV transfer to decode failed: {self.agent.error(pd.handle)}", "num_transfer_failed_reqs")
                return
        if pd.expired(now):
            self._fail(seq, 504, f"KV transfer timed out after {self.args.transfer_timeout:g}s", "num_transfer_timeout_reqs")

    def _check_decode_liveness(self, now: float) -> None:
        if self._timeout(1.0) is None:
            return
        limit = HEARTBEAT_INTERVAL_S * HEARTBEAT_MISSES
        for seq in list(self.inflight.values()):
            last = self.decode_heartbeats.get(seq.pd.peer_boot or "", now)
            if now - last > limit:
                self._fail(seq, 502, f"decode peer {seq.pd.peer_url} stopped answering (no heartbeat for {now - last:.1f}s)",
                           "num_transfer_failed_reqs")

    def abort_room(self, room: int, reason: str) -> None:
        """Decode gave up on this room: fail it here too, wherever it is."""
        seq = self.bootstrap.get(room) or self.inflight.get(room)
        if seq is None:
            seq = next((s for s in self.engine.seqs.values() if s.pd is not None and s.pd.room == room), None)
        self.pending.pop(room, None)
        if seq is not None:
            seq.pd.peer_url = None  # they know already
            self.engine.metrics.inc("num_aborted_reqs")
            self.engine.finish(seq, "abort", error=f"aborted by decode: {reason}", error_code=503)

    def on_finish(self, seq: Sequence) -> None:
        pd = seq.pd
        self.bootstrap.pop(pd.room, None)
        self.inflight.pop(pd.room, None)
        if pd.handle is not None:
            self.agent.release(pd.handle)
            pd.handle = None
        if pd.state is not PDState.SUCCESS and pd.peer_url:
            self.out.post(pd.peer_url + Paths.PD_ABORT, {"room": pd.room, "reason": seq.error or "aborted on prefill"})

    # ---- live state ------------------------------------------------------------------------------

    def oldest_inflight_age(self) -> float:
        now = time.monotonic()
        return max((now - s.pd.transfer_started for s in self.inflight.values()), default=0.0)

    def update_gauges(self, m) -> None:
        m.set("num_prefill_bootstrap_queue_reqs", len(self.bootstrap))
        m.set("num_prefill_inflight_queue_reqs", len(self.inflight))
        m.set("prefill_inflight_oldest_age_seconds", self.oldest_inflight_age())

    def loads(self) -> tuple[dict, dict]:
        now = time.monotonic()
        inflight = [{"rid": s.rid, "room": s.pd.room, "state": s.pd.state.value, "stalled": s.pd.stalled,
                     "age_seconds": round(now - s.pd.transfer_started, 3), "peer": s.pd.peer_url}
                    for s in list(self.inflight.values())]
        return ({"bootstrap": len(self.bootstrap), "inflight": len(self.inflight)},
                {"prefill_inflight_oldest_age_seconds": round(self.oldest_inflight_age(), 3),
                 "inflight_requests": inflight, "deadlines": self._timeout(1.0) is not None,
                 "boot_id": BOOT_ID})
