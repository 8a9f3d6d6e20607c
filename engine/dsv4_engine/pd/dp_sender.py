"""PD out of a prefill with data-parallel attention (`--dp-size N`): each request's pages are read
where they live, in the pool of the rank that computed them.

Rank 0 runs the scheduler and the PD controller, but rank p's pool is in rank p's process. So each
prefill rank registers its own pool with its own NIXL agent at start-up (as a TP decode's ranks
do, `pd.rank_pools`), and rank 0's transport (`DPSendTransport`) routes every write by the rank of
its source pages: rank 0's own through its agent, rank p's as a command to rank p's agent, sent
over NIXL as a notification (`write`: the decode's descriptor, the local source pages, the
destination pages and row, the decode's notification). On rank p a thread (`RankSender`) starts
that write from its own pool and, once it ends, tells rank 0 its state and bytes (`status`), which
rank 0's transport turns into the handle's state. Releasing a pending write sends `release`.

The pages are complete when rank 0 sends the command: it has rank p's logits of that step, which
rank p computed after writing the step's KV (on CUDA: later on the same stream). With checksums
asked, rank p sums what it sends and puts the sums into the notification (pd.checksum).
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence

from dsv4_engine.pd.dp_handoff import locate
from dsv4_engine.pd.transport import TransferInfo, TransferState, slot_args

log = logging.getLogger("dsv4.pd.dp_sender")

KIND = "dsv4_dp_send"  # marks rank 0 <-> rank p messages apart from anything else on the agents
IDLE_S = 0.002  # rank p's thread sleeps this long when nothing arrived


def encode(body: dict) -> bytes:
    return json.dumps({"kind": KIND, **body}).encode()


def decode(msg: bytes) -> Optional[dict]:
    """A rank <-> rank message, or None for anything else."""
    try:
        body = json.loads(msg)
    except ValueError:
        return None
    return body if isinstance(body, dict) and body.get("kind") == KIND else None


class RankSender:
    """On prefill rank p > 0: this rank's pool behind its own NIXL agent, and a thread that runs
    the writes rank 0 asks for and reports how each ended."""

    def __init__(self, agent, rank0_desc: dict, states, thread: bool = True):
        self.agent = agent
        self.states = states  # this rank's PoolStates (checksums of what it sends)
        self.rank0 = agent.add_peer(rank0_desc)
        self.writes: dict[int, int] = {}  # rank 0's id -> this agent's handle
        self.slot_base = 0  # the engine's id of this rank's slot row 0 (parallel.dp_pages.DPSlotAllocator)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if thread:
            self._thread = threading.Thread(target=self._run, name="dsv4-pd-dp-sender", daemon=True)
            self._thread.start()

    @classmethod
    def start(cls, pool, rank: int, gather: Callable[[dict], list[dict]]) -> "RankSender":
        from dsv4_engine.pd.common import BOOT_ID
        from dsv4_engine.pd.nixl.agent import KVTransferAgent
        from dsv4_engine.pd.transport import PoolStates

        states = PoolStates.of_pool(pool)
        agent = KVTransferAgent(f"prefill-{BOOT_ID}-rank{rank}", states, default_timeout_s=None)
        descs = gather(agent.descriptor())
        sender = cls(agent, descs[0], states)
        sender.slot_base = rank * pool.num_slots
        return sender

    def serve_once(self) -> int:
        """Take rank 0's commands, report the writes that ended; how many commands came."""
        got = self.agent.poll_notifs()
        for _peer, msg in got:
            body = decode(msg)
            if body is None:
                continue
            if body.get("op") == "write":
                self._write(body)
            elif body.get("op") == "release":
                h = self.writes.pop(body.get("id"), None)
                if h is not None:
                    self.agent.release(h)
        for wid, h in list(self.writes.items()):
            state = self.agent.poll(h)
            if state is not TransferState.PENDING:
                info = self.agent.info(h)
                self._report(wid, state, info.error, info.nbytes, info.nbytes_by_state)
                self.agent.release(h)
                del self.writes[wid]
        return len(got)

    def _write(self, body: dict) -> None:
        wid = body["id"]
        src_slot = body.get("src_slot")
        if src_slot is not None:  # the engine's slot row id: this rank's own row
            src_slot -= self.slot_base
        try:
            peer = self.agent.add_peer(body["desc"])
            notif = base64.b64decode(body["notif"])
            if body.get("checksum"):
                notif = self._with_checksums(notif, body["src"], src_slot)
            self.writes[wid] = self.agent.write_pages(
                peer, body["src"], body["dst"], notif, **slot_args(src_slot, body.get("dst_slot"))
            )
        except Exception as e:  # a write that cannot start ends FAILED on rank 0 too
            self._report(wid, TransferState.FAILED, f"rank could not start the write: {e}", 0, {})

    def _with_checksums(self, notif: bytes, src: list[int], src_slot: Optional[int]) -> bytes:
        from dsv4_engine.pd.checksum import region_checksums
        from dsv4_engine.pd.messages import TransferNote

        note = TransferNote.decode(notif)
        return replace(note, checksums=region_checksums(self.states, src, src_slot)).encode()

    def _report(self, wid: int, state: TransferState, error, nbytes: int, by_state: dict) -> None:
        msg = encode(
            {"op": "status", "id": wid, "state": state.value, "error": error, "nbytes": nbytes, "by_state": by_state}
        )
        if not self.agent.send_notif(self.rank0, msg):
            log.warning("could not tell rank 0 how write %s ended", wid)  # its transfer deadline fails it

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                got = self.serve_once()
            except Exception as e:  # the agent closed under us (the process is going down)
                log.warning("rank sender stopped: %s", e)
                return
            if not got:  # (a pending write is polled again after the nap: no core spun on it)
                time.sleep(IDLE_S)

    def close(self, timeout: Optional[float] = 1.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.agent.close()


class DPSendTransport:
    """Rank 0's KVTransport at a DP prefill: writes of rank 0's pages go through its own agent,
    writes of rank p's pages are run by rank p (`RankSender`). Page ids in are the global ids of
    rank 0's books (`parallel.dp_pages`)."""

    def __init__(self, agent, rank_descs: list[dict], pages_per_rank: int):
        self.agent = agent
        self.pages_per_rank = pages_per_rank
        self.rank_peers = [agent.add_peer(d) for d in rank_descs]  # ranks 1..
        self.descs: dict[str, dict] = {}  # decode peer name -> its descriptor (sent with rank p's writes)
        self._ids = itertools.count(1)
        self._local: dict[int, int] = {}  # our handle -> rank 0's agent's handle
        self._remote: dict[int, tuple[int, TransferInfo]] = {}  # our handle -> (rank, info)
        self._held: list[tuple[str, bytes]] = []  # notifications read while pumping statuses

    @property
    def name(self) -> str:
        return self.agent.name

    def descriptor(self) -> dict:
        return self.agent.descriptor()

    def add_peer(self, desc: dict) -> str:
        name = self.agent.add_peer(desc)  # checks the layout (every rank's pool shares rank 0's)
        self.descs[name] = desc
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
        checksum: bool = False,
    ) -> int:
        rank, local = locate(list(src_pages), self.pages_per_rank)
        handle = next(self._ids)
        if rank == 0:
            kw = {} if ready is None else {"ready": ready}
            self._local[handle] = self.agent.write_pages(
                peer, local, dst_pages, notif, **slot_args(src_slot, dst_slot), **kw
            )
            return handle
        if peer not in self.descs:
            raise ValueError(f"unknown peer {peer!r}: add_peer it first")
        now = time.monotonic()
        info = TransferInfo(handle, peer, len(local), 0, TransferState.PENDING, None, now, None)
        self._remote[handle] = (rank, info)
        body = {
            "op": "write",
            "id": handle,
            "desc": self.descs[peer],
            "src": local,
            "dst": list(dst_pages),
            "notif": base64.b64encode(notif).decode(),
            "src_slot": src_slot,
            "dst_slot": dst_slot,
            "checksum": checksum,
        }
        if not self.agent.send_notif(self.rank_peers[rank - 1], encode(body)):
            self._end(info, TransferState.FAILED, f"could not reach prefill rank {rank}")
        return handle

    def _end(self, info: TransferInfo, state: TransferState, error: Optional[str]) -> None:
        info.state, info.error, info.finished_at = state, error, time.monotonic()

    def _pump(self) -> None:
        """Apply the ranks' status reports; keep every other notification for poll_notifs."""
        for peer, msg in self.agent.poll_notifs():
            body = decode(msg)
            if body is None or body.get("op") != "status":
                self._held.append((peer, msg))
                continue
            got = self._remote.get(body.get("id"))
            if got is None:  # released meanwhile
                continue
            info = got[1]
            info.nbytes = int(body.get("nbytes") or 0)
            info.nbytes_by_state = dict(body.get("by_state") or {})
            self._end(info, TransferState(body.get("state")), body.get("error"))

    def poll(self, handle: int) -> TransferState:
        if handle in self._local:
            return self.agent.poll(self._local[handle])
        self._pump()
        return self._remote[handle][1].state

    def error(self, handle: int) -> Optional[str]:
        if handle in self._local:
            return self.agent.error(self._local[handle])
        return self._remote[handle][1].error

    def info(self, handle: int) -> TransferInfo:
        if handle in self._local:
            info = self.agent.info(self._local[handle])
            info.handle = handle
            return info
        return replace(self._remote[handle][1])

    def release(self, handle: int) -> None:
        if handle in self._local:
            self.agent.release(self._local.pop(handle))
            return
        got = self._remote.pop(handle, None)
        if got is not None and got[1].state is TransferState.PENDING:  # cancel it on its rank
            self.agent.send_notif(self.rank_peers[got[0] - 1], encode({"op": "release", "id": handle}))

    def poll_notifs(self) -> list[tuple[str, bytes]]:
        self._pump()
        out, self._held = self._held, []
        return out

    def close(self) -> None:
        self.agent.close()
