"""Prefill side of the hand-off: bootstrap queue -> forward -> inflight queue -> done.

A request waits in the bootstrap queue until its decode peer registers the pages (and, for a
model with slot states, the slot row) it reserved, is prefilled like any other request, then
sits in the inflight queue while every state region is written over the transport: its pages
into the decode's pages, its slot row into the decode's row (into every rank's pool of a decode
over several ranks, one transfer each; `pd.rank_pools`; at --dp-size N the rank that computed the
pages writes them, `pd.dp_sender`). With checksums on (our
--transfer-checksum, or the decode's registration asks) the notification carries a checksum
of each region as sent. Every one of those states has a deadline, a
failed or timed-out transfer frees the pages and tells decode, and a decode that stops answering
its heartbeat (died, restarted) fails its rooms at once instead of at the deadline.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field
from typing import Optional

from dsv4_engine.pd.common import HEARTBEAT_INTERVAL_S, HEARTBEAT_MISSES, PDController
from dsv4_engine.pd.request_info import PDState
from dsv4_engine.pd.checksum import region_checksums
from dsv4_engine.pd.dp_handoff import locate
from dsv4_engine.pd.messages import RegisterRoom, TransferNote
from dsv4_engine.pd.transport import TransferState, pages_ready, ready_arg, slot_args
from dsv4_engine.sequence import Sequence

log = logging.getLogger("dsv4.pd.prefill")
PENDING_REGISTRATION_TTL_S = 60.0
GONE_ROOM_TTL_S = 60.0  # how long a finished room is remembered, for registrations that arrive late


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
    dst_slot: Optional[int] = None  # the decode's slot row (models with slot states)
    checksum: bool = False  # the decode verifies region checksums
    local: bool = False  # the decode serves the room itself (pd.continuation): nothing to compute
    prompt_ids: Optional[list[int]] = None  # the decode's prompt when it differs (chat answer memo)
    rank_descs: list[dict] = field(default_factory=list)  # a decode over several ranks: its ranks 1..
    decode_dp_rank: Optional[int] = None  # a DP decode: the rank `desc` and `dst_pages` are (pd.dp_handoff)


class PrefillController(PDController):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bootstrap: dict[int, Sequence] = {}
        self.inflight: dict[int, Sequence] = {}
        self.registrations: "queue.Queue[Registration]" = queue.Queue()  # filled by the bootstrap server
        self.pending: dict[int, Registration] = {}  # registered before the request reached us
        self.gone: dict[int, tuple[float, bool]] = {}  # room that ended here -> (when, decode knows)
        self.dropped: dict[int, float] = {}  # room decode gave up on before its request reached us
        self.decode_heartbeats: dict[str, float] = {}  # decode boot id -> last time we heard from it
        self.bytes_by_state: dict[str, int] = {}  # moved by completed transfers, per state region
        self.bytes_by_rank: dict[int, int] = {}  # moved by completed transfers, per decode rank
        self.bytes_by_src_rank: dict[int, int] = {}  # --dp-size N: read from each of our ranks' pools
        self.checksum_seconds = 0.0  # time spent summing what was sent (--transfer-checksum's cost)
        # --dp-size N: a request's pages live in the pool of the rank that computed them (pd.dp_sender)
        self.dp = getattr(getattr(self.engine, "args", None), "dp_size", 1) > 1

    # ---- called from the bootstrap HTTP thread ---------------------------------------------------

    def register(self, msg: RegisterRoom) -> None:
        now = self.clock()
        reg = Registration(
            room=msg.room,
            desc=msg.desc,
            dst_pages=msg.dst_pages,
            decode_url=msg.decode_url,
            decode_boot=msg.decode_boot,
            received=now,
            apply_at=now + self.faults.bootstrap_delay(),
            dst_slot=msg.dst_slot,
            checksum=msg.checksum,
            local=msg.local,
            prompt_ids=msg.prompt_ids,
            rank_descs=msg.rank_descs,
            decode_dp_rank=msg.decode_dp_rank,
        )
        self.heartbeat(reg.decode_boot)
        self.registrations.put(reg)

    def heartbeat(self, decode_boot: str) -> None:
        self.decode_heartbeats[decode_boot] = self.clock()

    # ---- engine-thread hooks ---------------------------------------------------------------------

    def on_new(self, seq: Sequence) -> None:
        now = self.clock()
        seq.pd.mark("arrival", now)
        seq.pd.enter(PDState.BOOTSTRAPPING, self._timeout(self.settings.bootstrap_timeout), now)
        self.bootstrap[seq.pd.room] = seq
        if self.dropped.pop(seq.pd.room, None) is not None:
            self.pending.pop(seq.pd.room, None)
            seq.pd.peer_told = True
            self.engine.metrics.inc("num_aborted_reqs")
            self.engine.finish(seq, "abort", error="aborted by decode before the request arrived", error_code=503)
            return
        reg = self.pending.pop(seq.pd.room, None)
        if reg is not None:
            self.registrations.put(reg)

    def busy(self) -> bool:
        return bool(self.bootstrap or self.inflight or not self.registrations.empty())

    def poll(self) -> None:
        now = self.clock()
        self._take_registrations(now)
        self.transport.poll_notifs()  # lets NIXL connection setup progress (no progress thread)
        for seq in list(self.inflight.values()):
            self._poll_transfer(seq, now)
        for seq in list(self.bootstrap.values()):
            if seq.pd.expired(now):
                self._fail(
                    seq,
                    504,
                    f"bootstrap timed out after {self.settings.bootstrap_timeout:g}s: "
                    f"no decode peer registered room {seq.pd.room}",
                    "num_bootstrap_failed_reqs",
                )
        self._check_decode_liveness(now)
        for room, reg in list(self.pending.items()):
            if now - reg.received > PENDING_REGISTRATION_TTL_S:
                del self.pending[room]
        for room, (when, _) in list(self.gone.items()):
            if now - when > GONE_ROOM_TTL_S:
                del self.gone[room]
        for room, when in list(self.dropped.items()):
            if now - when > GONE_ROOM_TTL_S:
                del self.dropped[room]
        for boot, when in list(self.decode_heartbeats.items()):  # decodes long gone (restarted, scaled in)
            if now - when > GONE_ROOM_TTL_S:
                self.decode_heartbeats.pop(boot, None)

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
            if seq is not None:
                self._apply_registration(seq, reg)
            elif reg.room in self.dropped:
                continue  # decode registered, then gave up on the room: nothing to keep
            elif reg.room in self.gone:
                # The room already ended here: the decode waiting on it must hear so, once.
                _, told = self.gone[reg.room]
                if not told:
                    self.gone[reg.room] = (now, True)
                    self.channel.abort_decode(reg.decode_url, reg.room, "the request already ended on prefill")
            else:
                self.pending[reg.room] = reg
        for reg in deferred:
            self.registrations.put(reg)

    def _apply_registration(self, seq: Sequence, reg: Registration) -> None:
        seq.pd.peer_url = reg.decode_url  # from here on, a failure is told to this decode
        seq.pd.peer_boot = reg.decode_boot
        if reg.local:
            # Decode holds the conversation and computes its new tail itself: end the room here as
            # a success (the router's prefill leg answers 200), having computed and sent nothing.
            del self.bootstrap[seq.pd.room]
            seq.pd.state = PDState.SUCCESS
            seq.pd.mark("served_by_decode", self.clock())
            self.engine.metrics.inc("num_decode_local_reqs")
            self.engine.finish(seq, "stop")
            return
        if reg.prompt_ids is not None:
            why = self._prompt_refusal(reg.prompt_ids)
            if why is not None:
                self._fail(seq, 400, f"decode's prompt ids: {why}", "num_bootstrap_failed_reqs")
                return
            seq.prompt_ids = list(reg.prompt_ids)  # decode spliced remembered chat answers
        need = -(-seq.num_tokens // self.engine.pool.page_size)  # prompt (+ a continuation's tokens)
        if len(reg.dst_pages) < need:
            self._fail(
                seq,
                500,
                f"decode reserved {len(reg.dst_pages)} pages, prompt needs {need}",
                "num_bootstrap_failed_reqs",
            )
            return
        try:  # a decode over several ranks: each rank's own pool, rank 0's first (pd.rank_pools)
            seq.pd.rank_peers = [self.transport.add_peer(d) for d in (reg.desc, *reg.rank_descs)]
            seq.pd.peer = seq.pd.rank_peers[0]
        except Exception as e:  # unreachable, or a layout that cannot receive ours
            self._fail(seq, 502, f"cannot connect to decode peer: {e}", "num_bootstrap_failed_reqs")
            return
        if self.engine.pool.slots is not None and reg.dst_slot is None:
            self._fail(
                seq,
                500,
                f"decode reserved no slot row for this model's slot states ({', '.join(self.states.slots)})",
                "num_bootstrap_failed_reqs",
            )
            return
        del self.bootstrap[seq.pd.room]
        seq.pd.dst_pages = reg.dst_pages[:need]
        seq.pd.dst_slot = reg.dst_slot if self.engine.pool.slots is not None else None
        seq.pd.checksum = reg.checksum or self.settings.transfer_checksum
        seq.pd.decode_dp_rank = reg.decode_dp_rank
        seq.pd.enter(PDState.WAITING_FOR_INPUT, None, self.clock())  # now an ordinary prefill in the scheduler
        self.engine.scheduler.add(seq)

    def _prompt_refusal(self, ids: list[int]) -> Optional[str]:
        """Why decode's prompt ids cannot be computed here, or None."""
        vocab = self.engine.cfg.vocab_size
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            return f"token id {bad} is out of range [0, {vocab})"
        if len(ids) >= self.engine.max_model_len:
            return f"{len(ids)} tokens leave no room in the context ({self.engine.max_model_len})"
        return None

    def on_prefill_done(self, seq: Sequence) -> None:
        """First token sampled: state pages go to decode, with the token in the notification."""
        self.engine.scheduler.remove(seq)
        pd = seq.pd
        now = self.clock()
        pd.mark("forward_done", now)
        pd.enter(PDState.TRANSFERRING, self._timeout(self.settings.transfer_timeout), now)
        pd.transfer_started = now
        self.inflight[pd.room] = seq
        logprobs = getattr(seq, "output_logprobs", None)
        n = len(pd.dst_pages)
        src_slot = seq.slot if pd.dst_slot is not None else None
        # at --dp-size N the pages live in one rank's pool, which writes them (pd.dp_sender)
        src_rank, local = locate(seq.pages[:n], self.engine.pool.allocator.pages_per_rank) if self.dp else (None, [])
        pd.prefill_dp_rank = src_rank
        checksums = None
        if pd.checksum and src_rank in (None, 0):
            t0 = time.perf_counter()
            checksums = region_checksums(self.states, local if self.dp else seq.pages[:n], src_slot)
            self.checksum_seconds += time.perf_counter() - t0
        # another rank's pool is summed by that rank, which puts the sums into the notification
        by_rank = {"checksum": pd.checksum and src_rank != 0} if self.dp else {}
        # The kernels that wrote these pages are queued by now: the transport waits for them alone,
        # once for every rank's write, not for whatever the stream holds later (None on CPU).
        ready = pages_ready(self.engine.pool.tensor)
        try:
            for rank, peer in enumerate(pd.rank_peers or [pd.peer]):  # each decode rank's own pool
                note = TransferNote(
                    pd.room,
                    seq.output_ids[-1],
                    self.boot_id,
                    seq.num_cached_tokens,
                    logprobs[-1] if logprobs else None,
                    checksums,
                    rank if pd.decode_dp_rank is None else pd.decode_dp_rank,
                    src_rank,
                )
                pd.handles.append(
                    self.transport.write_pages(
                        peer,
                        seq.pages[:n],
                        pd.dst_pages,
                        note.encode(),
                        **slot_args(src_slot, pd.dst_slot),
                        **ready_arg(ready),
                        **by_rank,
                    )
                )
            pd.handle = pd.handles[0]
        except Exception as e:  # the writes already started end with the room (on_finish)
            self._fail(seq, 502, f"KV transfer could not start: {e}", "num_transfer_failed_reqs")

    def _poll_transfer(self, seq: Sequence, now: float) -> None:
        pd = seq.pd
        if pd.handles:
            states = [self.transport.poll(h) for h in pd.handles]  # one per decode rank
            failed = next((r for r, st in enumerate(states) if st is TransferState.FAILED), None)
            if failed is not None:  # any rank's share lost fails the request (decode frees its pages)
                rank = f" rank {failed}" if len(pd.handles) > 1 else ""
                self._fail(
                    seq,
                    502,
                    f"KV transfer to decode{rank} failed: {self.transport.error(pd.handles[failed])}",
                    "num_transfer_failed_reqs",
                )
                return
            if all(st is TransferState.DONE for st in states):
                m = self.engine.metrics
                m.inc("kv_transfers_completed")
                for rank, h in enumerate(pd.handles):
                    info = self.transport.info(h)
                    rank = rank if pd.decode_dp_rank is None else pd.decode_dp_rank  # a DP decode: its one rank
                    m.inc("kv_transfer_bytes", info.nbytes)
                    self.bytes_by_rank[rank] = self.bytes_by_rank.get(rank, 0) + info.nbytes
                    if pd.prefill_dp_rank is not None:
                        src = pd.prefill_dp_rank
                        self.bytes_by_src_rank[src] = self.bytes_by_src_rank.get(src, 0) + info.nbytes
                    for name, nbytes in info.nbytes_by_state.items():
                        self.bytes_by_state[name] = self.bytes_by_state.get(name, 0) + nbytes
                m.observe("kv_transfer_latency_seconds", now - pd.transfer_started)
                pd.state = PDState.SUCCESS
                pd.mark("transfer_done", now)
                self.engine.finish(seq, "stop")
                return
        if pd.expired(now):
            pending = [r for r, h in enumerate(pd.handles) if self.transport.poll(h) is TransferState.PENDING]
            ranks = f" (decode rank{'s' if len(pending) > 1 else ''} {', '.join(map(str, pending))})"
            self._fail(
                seq,
                504,
                f"KV transfer timed out after {self.settings.transfer_timeout:g}s"
                + (ranks if len(pd.handles) > 1 and pending else ""),
                "num_transfer_timeout_reqs",
            )

    def _check_decode_liveness(self, now: float) -> None:
        if not self.deadlines.on:
            return
        limit = HEARTBEAT_INTERVAL_S * HEARTBEAT_MISSES
        for seq in list(self.inflight.values()):
            last = self.decode_heartbeats.get(seq.pd.peer_boot or "", now)
            if now - last > limit:
                self._fail(
                    seq,
                    502,
                    f"decode peer {seq.pd.peer_url} stopped answering (no heartbeat for {now - last:.1f}s)",
                    "num_transfer_failed_reqs",
                )

    def abort_room(self, room: int, reason: str) -> None:
        """Decode gave up on this room: fail it here too, wherever it is."""
        seq = self.bootstrap.get(room) or self.inflight.get(room)
        if seq is None:
            seq = next((s for s in self.engine.seqs.values() if s.pd is not None and s.pd.room == room), None)
        self.pending.pop(room, None)
        if seq is None:
            if room in self.gone:
                self.gone[room] = (self.gone[room][0], True)  # so a late registration is not answered
            else:
                self.dropped[room] = self.clock()  # the request may still be on its way here
            return
        seq.pd.peer_told = True
        self.engine.metrics.inc("num_aborted_reqs")
        self.engine.finish(seq, "abort", error=f"aborted by decode: {reason}", error_code=503)

    def on_finish(self, seq: Sequence) -> None:
        pd = seq.pd
        self.bootstrap.pop(pd.room, None)
        self.inflight.pop(pd.room, None)
        for h in pd.handles:
            self.transport.release(h)
        pd.handles, pd.handle = [], None
        if pd.state is PDState.SUCCESS:
            self.gone[pd.room] = (self.clock(), True)
            return
        told = pd.peer_told or pd.peer_url is not None
        self.gone[pd.room] = (self.clock(), told)
        if pd.peer_url is not None and not pd.peer_told:
            self.channel.abort_decode(pd.peer_url, pd.room, seq.error or "aborted on prefill")

    # ---- live state ------------------------------------------------------------------------------

    def oldest_inflight_age(self) -> float:
        now = self.clock()
        return max((now - s.pd.transfer_started for s in self.inflight.values()), default=0.0)

    def update_gauges(self, m) -> None:
        m.set("num_prefill_bootstrap_queue_reqs", len(self.bootstrap))
        m.set("num_prefill_inflight_queue_reqs", len(self.inflight))
        m.set("prefill_inflight_oldest_age_seconds", self.oldest_inflight_age())

    def waiting(self) -> int:
        return len(self.bootstrap)

    def loads(self) -> tuple[dict, dict]:
        now = self.clock()
        inflight = [
            {
                "rid": s.rid,
                "room": s.pd.room,
                "state": s.pd.state.value,
                "age_seconds": round(now - s.pd.transfer_started, 3),
                "peer": s.pd.peer_url,
            }
            for s in list(self.inflight.values())
        ]
        return (
            {"bootstrap": len(self.bootstrap), "inflight": len(self.inflight)},
            {
                "prefill_inflight_oldest_age_seconds": round(self.oldest_inflight_age(), 3),
                "inflight_requests": inflight,
                "requests": self.timelines(),
                "deadlines": self.deadlines.on,
                "boot_id": self.boot_id,
                "kv_transfer_bytes_by_state": dict(self.bytes_by_state),
                "kv_transfer_bytes_by_rank": {str(r): n for r, n in sorted(self.bytes_by_rank.items())},
                **(
                    {
                        "kv_transfer_bytes_by_prefill_rank": {
                            str(r): n for r, n in sorted(self.bytes_by_src_rank.items())
                        }
                    }
                    if self.dp
                    else {}
                ),
                "transfer_checksum_seconds": round(self.checksum_seconds, 6),
            },
        )
