"""Decode side of the hand-off: prealloc queue -> register with prefill -> transfer queue ->
running.

A request reserves pages for its prompt (and, for a model with slot states such as
DeepSeek-V4's window ring and compressor stages, a slot row), tells the prefill's bootstrap
endpoint where they are, and waits for the notification that every state region (and the first
token) landed. With --transfer-checksum it asks prefill for a checksum of each region as sent
and compares it with what landed; a mismatch fails the request (502) and counts
kv_transfer_checksum_failed. It then
decodes like any other request. Waiting has a deadline, a prefill that stops answering its
heartbeat or comes back as a different process fails its rooms at once, and every failure frees
the reserved pages and tells prefill to drop the room.

Liveness of a prefill is judged only while rooms wait on it: a peer is watched from the moment
a room starts waiting on it and forgotten when none does, so an idle spell never counts as
missed heartbeats (the first request after a pause used to fail on a stale clock).

The KV can land before decode has taken in prefill's answer to its registration: prefill
prefills and writes as soon as it has the registration, while the answer still waits for one
of decode's outbound HTTP threads or in its inbox. A notification for a room still registering
is kept and applied the moment the registration completes (dropping it left the request
waiting until its deadline: 1-8 in 200 under ~200 concurrent PD requests).

A decode over several TP ranks names every rank's own pool in the registration; prefill writes
each rank's share there and the request lands once every rank's notification is in
(`pd.rank_pools`). A decode with data-parallel attention picks one rank by load and names that
rank's pool alone; the request lands with that rank's notification (`pd.dp_handoff`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

from dsv4_engine.pd.checksum import checksum_mismatch, region_checksums
from dsv4_engine.pd.common import HEARTBEAT_INTERVAL_S, HEARTBEAT_MISSES, PDController
from dsv4_engine.pd.continuation import cached_prefix_tokens, serve_locally
from dsv4_engine.pd.dp_handoff import awaited_ranks, dp_rank_refusal, locate
from dsv4_engine.pd.messages import RegisterRoom, TransferNote
from dsv4_engine.pd.rank_pools import missing_ranks, rank_refusal
from dsv4_engine.pd.request_info import PDState
from dsv4_engine.sequence import Sequence

log = logging.getLogger("dsv4.pd.decode")


@dataclass
class PrefillPeer:
    """A prefill some room waits on: its process identity and when we last heard from it."""

    boot: Optional[str]
    last_heard: float
    asked: float = float("-inf")
    asking: bool = False  # a heartbeat is in flight


class DecodeController(PDController):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prealloc: deque[Sequence] = deque()
        self.registering: dict[int, Sequence] = {}
        self.transfer: dict[int, Sequence] = {}
        # room -> rank -> its notification: what landed (while registering, too) before every rank's did
        self.arrived: dict[int, dict[int, TransferNote]] = {}
        # at --tp-size > 1 the other ranks' transport descriptors (pd.rank_pools): prefill writes
        # each rank's share into that rank's own pool, and a request lands once every rank's has
        self.rank_descs: list[dict] = []
        # at --dp-size N every rank's transport descriptor, rank 0's first (pd.dp_handoff): a
        # request's KV lands in the pool of the one rank it was placed on
        self.dp_descs: list[dict] = []
        self.bytes_by_rank: dict[int, int] = {}  # state bytes that landed in each rank's pool
        self.prefills: dict[str, PrefillPeer] = {}  # bootstrap address -> peer, while rooms wait on it
        self.checksum_seconds = 0.0  # time spent verifying what landed (--transfer-checksum's cost)

    def on_new(self, seq: Sequence) -> None:
        seq.pd.mark("arrival", self.clock())
        if self._serve_locally(seq):
            return
        seq.pd.enter(PDState.BOOTSTRAPPING, self._timeout(self.settings.bootstrap_timeout), self.clock())
        self.prealloc.append(seq)

    def _serve_locally(self, seq: Sequence) -> bool:
        """--decode-local-prefill: when this engine's prefix cache holds all of the request but a
        short tail (the next round of a conversation it served), compute the tail here like a
        monolithic engine and tell prefill to drop the room (pd.continuation)."""
        limit = self.engine.args.decode_local_prefill
        cache = self.engine.prefix_cache
        if not limit or cache is None:
            return False
        cached, continues = cached_prefix_tokens(cache, seq)
        if not serve_locally(seq.num_tokens, cached, limit, continues):
            return False
        now = self.clock()
        seq.pd.enter(PDState.SUCCESS, None, now)
        seq.pd.mark("served_by_decode", now)
        msg = RegisterRoom(
            room=seq.pd.room,
            rid=seq.rid,
            desc=self.transport.descriptor(),
            dst_pages=[],
            decode_url=self.settings.url,
            decode_boot=self.boot_id,
            local=True,
        )
        self.channel.register(seq.pd.bootstrap_addr, msg, lambda res, err, seq=seq: self._released(seq, err))
        self.engine.metrics.inc("num_decode_local_reqs")
        self.engine.scheduler.add(seq)
        return True

    def _released(self, seq: Sequence, err: Optional[str]) -> None:
        """Prefill's answer to a local registration: nothing waits on it. A lost one leaves
        prefill's copy of the room to its bootstrap deadline; tell it once more to drop it."""
        if err is not None:
            log.warning("could not tell prefill that room %s is served here: %s", seq.pd.room, err)
            self.channel.abort_prefill(seq.pd.bootstrap_addr, seq.pd.room, "served by decode from its own cache")

    def busy(self) -> bool:
        return bool(self.prealloc or self.registering or self.transfer)

    def poll(self) -> None:
        now = self.clock()
        self._preallocate()
        for _peer, msg in self.transport.poll_notifs():
            self._on_notif(msg)
        for seq in list(self.prealloc) + list(self.registering.values()):
            if seq.pd.expired(now):
                self._fail(
                    seq,
                    504,
                    f"bootstrap with prefill {seq.pd.bootstrap_addr} timed out after "
                    f"{self.settings.bootstrap_timeout:g}s",
                    "num_bootstrap_failed_reqs",
                )
        for seq in list(self.transfer.values()):
            if seq.pd.expired(now):
                missing = missing_ranks(self.arrived.get(seq.pd.room, {}), self._awaited(seq))
                ranks = f" (rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))})"
                self._fail(
                    seq,
                    504,
                    f"KV from prefill did not arrive within {self.settings.waiting_timeout:g}s"
                    + (ranks if self.num_ranks > 1 else ""),
                    "num_transfer_timeout_reqs",
                )
        self._heartbeats(now)

    def _preallocate(self) -> None:
        pool = self.engine.pool
        if self.engine.scheduler.waiting:
            # Only requests this decode preempted wait there: they resume first. Preallocating
            # runs before each step's schedule, so new hand-offs would otherwise take the pages
            # and slot row a preempted request gave back, for as long as new requests come.
            return
        while self.prealloc:
            seq = self.prealloc[0]
            need = -(-seq.num_tokens // pool.page_size)  # prompt (+ a continuation's tokens)
            books = pool.allocator
            pages = books.allocate_to_receive(need) if self.dp_descs else books.allocate(need)
            if pages is None:
                return  # FCFS: wait for pages; the bootstrap deadline bounds the wait
            slot = None
            if pool.slots is not None:
                slot = pool.slots.allocate_beside(pages) if pool.slots.follows_pages else pool.slots.allocate()
                if slot is None:
                    pool.allocator.free(pages)
                    return  # every slot row is taken: wait like for pages
            self.prealloc.popleft()
            seq.pages, seq.slot = pages, slot
            self.registering[seq.pd.room] = seq
            desc, dst_pages, dp_rank = self.transport.descriptor(), pages, None
            if self.dp_descs:  # the pool of the rank it was placed on, in that pool's page ids
                dp_rank, dst_pages = locate(pages, books.pages_per_rank)
                desc = self.dp_descs[dp_rank]
                if slot is not None:  # its row among that rank's (parallel.dp_pages.DPSlotAllocator)
                    slot -= dp_rank * pool.num_slots
                seq.pd.mark(f"placed_on_rank_{dp_rank}", self.clock())
            msg = RegisterRoom(
                room=seq.pd.room,
                rid=seq.rid,
                desc=desc,
                dst_pages=dst_pages,
                decode_url=self.settings.url,
                decode_boot=self.boot_id,
                dst_slot=slot,
                checksum=self.settings.transfer_checksum,
                rank_descs=self.rank_descs,
                decode_dp_rank=dp_rank,
                # chat answers spliced as their generated ids (dsv4_serve.chat.answer_memo): prefill,
                # which tokenized the text, computes these ids instead, so both sides hold one prompt
                prompt_ids=seq.prompt_ids if seq.plain_prompt_ids not in (None, seq.prompt_ids) else None,
            )
            self.channel.register(seq.pd.bootstrap_addr, msg, lambda res, err, seq=seq: self._registered(seq, res, err))

    def _registered(self, seq: Sequence, res: Optional[dict], err: Optional[str]) -> None:
        if seq.finished or self.registering.pop(seq.pd.room, None) is None:
            return
        if err is None and not isinstance(res, dict):
            err = f"registration answer is not a JSON object: {res!r:.80}"
        if err is None:
            err = dp_rank_refusal(res) if self.dp_descs else rank_refusal(res, self.num_ranks)
        if err is not None:
            # Prefill may have taken the registration (our call timed out, its answer was lost):
            # tell it, or it could write into pages we are about to hand to another request.
            self.channel.abort_prefill(seq.pd.bootstrap_addr, seq.pd.room, f"decode gave up registering: {err}")
            seq.pd.peer_told = True
            self._fail(seq, 502, f"cannot register with prefill: {err}", "num_bootstrap_failed_reqs")
            return
        now = self.clock()
        seq.pd.peer_boot = res.get("boot_id")
        peer = self.prefills.get(seq.pd.bootstrap_addr)
        if peer is None:
            self.prefills[seq.pd.bootstrap_addr] = PrefillPeer(seq.pd.peer_boot, now)
        else:  # its answer is news of it: alive now
            peer.boot, peer.last_heard = seq.pd.peer_boot, now
        seq.pd.enter(PDState.TRANSFERRING, self._timeout(self.settings.waiting_timeout), now)
        seq.pd.transfer_started = now
        self.transfer[seq.pd.room] = seq
        self._land_when_complete(seq.pd.room)

    def _on_notif(self, msg: bytes) -> None:
        try:
            note = TransferNote.decode(msg)
        except ValueError as e:
            log.warning("ignoring malformed notification %r: %s", msg[:100], e)
            return
        room = note.room
        if not 0 <= note.rank < self.num_ranks:
            log.warning("ignoring a notification for room %s from rank %s of %s", room, note.rank, self.num_ranks)
            return
        if room not in self.registering and room not in self.transfer:
            return  # a room we already gave up on
        # (one landing before we took in prefill's answer to the registration is kept too)
        self.arrived.setdefault(room, {})[note.rank] = note
        self._land_when_complete(room)

    @property
    def num_ranks(self) -> int:
        return len(self.dp_descs) or 1 + len(self.rank_descs)

    def _dp_rank(self, seq: Sequence) -> Optional[int]:
        """At --dp-size N the rank whose pool holds the request's pages; None under TP."""
        return locate(seq.pages, self.engine.pool.allocator.pages_per_rank)[0] if self.dp_descs else None

    def _awaited(self, seq: Sequence) -> list[int]:
        return awaited_ranks(self._dp_rank(seq), self.num_ranks)

    def _land_when_complete(self, room: int) -> None:
        arrived = self.arrived.get(room, {})
        seq = self.transfer.get(room)
        if seq is None or missing_ranks(arrived, self._awaited(seq)):
            return
        del self.transfer[room]
        del self.arrived[room]
        if not seq.finished:
            self._land(seq, arrived[self._awaited(seq)[0]])

    def _land(self, seq: Sequence, note: TransferNote) -> None:
        """The request's state and first token are here (in every rank's pool): it decodes from now on."""
        m = self.engine.metrics
        why = self._checksum_failure(seq, note)
        if why is not None:
            m.inc("num_transfer_failed_reqs")
            self._fail(seq, 502, why, "kv_transfer_checksum_failed")
            return
        m.inc("kv_transfers_completed")
        pool = self.engine.pool
        row = sum(pool.bytes_per_request().values()) if seq.slot is not None else 0
        share = len(seq.pages) * pool.page_nbytes + row  # each awaited rank's pool received the whole state
        ranks = self._awaited(seq)
        for r in ranks:
            self.bytes_by_rank[r] = self.bytes_by_rank.get(r, 0) + share
        m.inc("kv_transfer_bytes", share * len(ranks))
        m.observe("kv_transfer_latency_seconds", self.clock() - seq.pd.transfer_started)
        seq.pd.state = PDState.SUCCESS
        seq.pd.mark("kv_landed", self.clock())
        seq.num_computed = seq.num_tokens
        if self.engine.prefix_cache is not None:
            # --decode-local-prefill: the landed prompt is this engine's to reuse from now on, and a
            # prompt ending on a boundary is snapshotted here, the one time its row stands there
            self.engine.scheduler.computed(seq)
        # prompt tokens prefill's prefix cache served (the client's usage.cached_tokens)
        seq.num_cached_tokens = note.cached_tokens if note.cached_tokens <= len(seq.prompt_ids) else 0
        self.engine.accept_first_token(seq, note.token, note.logprobs)

    def _checksum_failure(self, seq: Sequence, note: TransferNote) -> Optional[str]:
        """Why what landed is not what prefill sent (checksums in the notification), or None."""
        sent = note.checksums
        if sent is None:
            if self.settings.transfer_checksum:
                return "prefill sent no transfer checksums (--transfer-checksum is on here): cannot verify the KV"
            return None
        pages = seq.pages
        if self.dp_descs:  # rank 0 reads its own pool only (--transfer-checksum is refused at --dp-size > 1)
            rank, pages = locate(seq.pages, self.engine.pool.allocator.pages_per_rank)
            if rank != 0:
                return None
        t0 = time.perf_counter()
        landed = region_checksums(self.states, pages, seq.slot)
        self.checksum_seconds += time.perf_counter() - t0
        return checksum_mismatch(sent, landed)

    def _heartbeats(self, now: float) -> None:
        """Ask each prefill we wait on whether it is alive and still the same process."""
        waiting_on = {s.pd.bootstrap_addr for s in self.transfer.values()}
        for addr in [a for a in self.prefills if a not in waiting_on]:
            del self.prefills[addr]  # nothing waits on it: silence from it is not a miss
        for addr in waiting_on:
            peer = self.prefills.setdefault(addr, PrefillPeer(None, now))
            if self.deadlines.on and now - peer.last_heard > HEARTBEAT_INTERVAL_S * HEARTBEAT_MISSES:
                self._fail_prefill(addr, f"prefill {addr} stopped answering for {now - peer.last_heard:.1f}s")
                continue
            if not peer.asking and now - peer.asked >= HEARTBEAT_INTERVAL_S:
                peer.asking, peer.asked = True, now
                self.channel.heartbeat(
                    addr,
                    self.boot_id,
                    lambda res, err, addr=addr, peer=peer: self._heartbeat_answer(addr, peer, res, err),
                )

    def _heartbeat_answer(self, addr: str, peer: PrefillPeer, res: Optional[dict], err: Optional[str]) -> None:
        peer.asking = False
        if err is not None or self.prefills.get(addr) is not peer:
            return
        peer.last_heard = self.clock()
        boot = res.get("boot_id")
        for seq in [s for s in self.transfer.values() if s.pd.bootstrap_addr == addr and s.pd.peer_boot != boot]:
            self._fail(
                seq, 502, f"prefill {addr} restarted while sending this request's KV", "num_transfer_failed_reqs"
            )

    def _fail_prefill(self, addr: str, msg: str) -> None:
        for seq in [s for s in self.transfer.values() if s.pd.bootstrap_addr == addr]:
            self._fail(seq, 502, msg, "num_transfer_failed_reqs")

    def abort_room(self, room: int, reason: str) -> None:
        """Prefill gave up on this room: the client hears it now, not at our deadline."""
        seq = self.transfer.get(room) or self.registering.get(room)
        if seq is None:
            seq = next((s for s in self.prealloc if s.pd.room == room), None)
        if seq is not None:
            seq.pd.peer_told = True  # no echo back
            self._fail(seq, 502, f"prefill failed this request: {reason}", "num_transfer_failed_reqs")

    def on_finish(self, seq: Sequence) -> None:
        pd = seq.pd
        was_waiting = pd.room in self.transfer or pd.room in self.registering or seq in self.prealloc
        self.transfer.pop(pd.room, None)
        self.registering.pop(pd.room, None)
        self.arrived.pop(pd.room, None)
        if seq in self.prealloc:
            self.prealloc.remove(seq)
        if was_waiting and not pd.peer_told:
            self.channel.abort_prefill(pd.bootstrap_addr, pd.room, seq.error or seq.finish_reason or "aborted")

    def update_gauges(self, m) -> None:
        m.set("num_decode_prealloc_queue_reqs", len(self.prealloc) + len(self.registering))
        m.set("num_decode_transfer_queue_reqs", len(self.transfer))

    def waiting(self) -> int:
        return len(self.prealloc) + len(self.registering)

    def loads(self) -> tuple[dict, dict]:
        return (
            {"prealloc": len(self.prealloc) + len(self.registering), "transfer": len(self.transfer)},
            {
                "deadlines": self.deadlines.on,
                "boot_id": self.boot_id,
                "requests": self.timelines(),
                "transfer_checksum_seconds": round(self.checksum_seconds, 6),
                "kv_transfer_bytes_by_rank": {str(r): n for r, n in sorted(self.bytes_by_rank.items())},
            },
        )
