"""Speculative decoding over N ranks (`--tp-size N --speculative-algorithm mtp`).

Rank 0 runs the speculator (dsv4_engine.spec_decode.speculator) as a single rank does: it
schedules, verifies, picks the drafts and decides what each request keeps. Every forward the
speculator runs is a forward of the sharded model (all-reduces inside), so each one reaches the
other ranks first, in the order rank 0 runs them:
- the target over a step's tokens (prefill chunks, last tokens with their drafts);
- each forward of the MTP block (the catch-up, every step of the draft chain), with the hidden
  states it reads broadcast from rank 0: the draft tokens in its batch were picked there, and the
  block then computes on the same input on every rank;
- V4's ring rollbacks: the save before a forward writes drafts' positions, and the put-back after
  rank 0 verified them, whose bounds (each request's first rejected position) carry the accept
  decision to every rank.
The other ranks compute no logits and verify nothing (the head is replicated: rank 0's is enough).
Pages and slot rows are rank 0's books; every rank's pool mirrors its shape, MTP state included,
and every rank writes the same positions of it.

With --cuda-graph-max-bs every rank captures the speculator's graph sets at start-up, together
(`capture_on_every_rank`: OP_CAPTURE, then an agreement after every bucket of every set, so a
failure anywhere ends capture everywhere with one line), and all keep them or none. A step that
fits them then reaches the other ranks as its host arrays (`wire.pack_host`, no read of the
device), plus the hidden states a draft or catch-up reads, and every rank replays its own graph
(`BroadcastSpecGraphs`); steps that do not fit go as the eager forwards above.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from dsv4_engine.parallel import wire
from dsv4_engine.spec_decode.graphs import capture_here
from dsv4_engine.spec_decode.mtp_v4 import RingRollback


def _send(group, header: torch.Tensor, payload: torch.Tensor) -> None:
    dist.broadcast(header, 0, group=group.rank.control)
    dist.broadcast(payload, 0, group=group.rank.control)


def _on_wire(x: torch.Tensor) -> torch.Tensor:
    """gloo (CPU) broadcasts float32 as we want; other float types travel as float32 (exact)."""
    return x.contiguous() if x.is_cuda or x.dtype == torch.float32 else x.float().contiguous()


def send_hidden(group, x: torch.Tensor) -> None:
    dist.broadcast(wire.hidden_meta(x), 0, group=group.rank.control)
    dist.broadcast(_on_wire(x), 0, group=group.rank.compute)


def receive_hidden(rank, device: torch.device) -> torch.Tensor:
    meta = torch.zeros(wire.HIDDEN_META_LEN, dtype=torch.int64)
    dist.broadcast(meta, 0, group=rank.control)
    x = wire.empty_hidden(meta, device)
    buf = _on_wire(x)
    dist.broadcast(buf, 0, group=rank.compute)
    return buf if buf is x else buf.to(x.dtype)


# ---- rank 0 --------------------------------------------------------------------------------------


class BroadcastTarget:
    """The speculator's target on rank 0: its forward reaches the other ranks first."""

    def __init__(self, target, group):
        self.target, self.group = target, group

    def hidden(self, fb, states: dict) -> torch.Tensor:
        with self.group.step("a speculative target step on rank 0"):
            _send(self.group, *wire.pack(fb, wire.OP_SPEC_TARGET))
            return self.target.hidden(fb, states)

    def __getattr__(self, name):
        return getattr(self.target, name)


class BroadcastMTP:
    """The speculator's MTP block on rank 0: each forward, and the hidden states it reads, reach
    the other ranks first."""

    def __init__(self, mtp, group):
        self.mtp, self.group = mtp, group

    def forward(self, fb, states: dict, prev: torch.Tensor, rows: Optional[torch.Tensor] = None):
        with self.group.step("a speculative MTP step on rank 0"):
            _send(self.group, *wire.pack(fb, wire.OP_SPEC_MTP))
            send_hidden(self.group, prev)
            return self.mtp.forward(fb, states, prev, rows)

    def __getattr__(self, name):
        return getattr(self.mtp, name)


class OwnRowsRollback(RingRollback):
    """A RingRollback of the entries whose slot rows are rank `rank`'s, at its local rows: under
    --dp-size each rank's pool holds only rows rank * per_rank.. (parallel.dp_pages); per_rank 0
    (tensor parallelism): every entry, every rank holding every row."""

    def __init__(self, rings: dict, rows: list[int], positions: list[int], rank: int = 0, per_rank: int = 0):
        self._mine = [k for k, row in enumerate(rows) if not per_rank or row // per_rank == rank]
        base = rank * per_rank
        super().__init__(rings, [rows[k] - base for k in self._mine], [positions[k] for k in self._mine])

    def restore(self, keep_below: Optional[list[int]] = None) -> None:
        super().restore(None if keep_below is None else [keep_below[k] for k in self._mine])


def mirrored_rollback(group, slot_names, per_rank: int = 0):
    """A RingRollback class whose save and put-back every other rank repeats on its own rings
    (per_rank > 0, --dp-size: each rank on its own rows only)."""
    order = sorted(slot_names)

    class MirroredRollback(OwnRowsRollback):
        def __init__(self, rings: dict, rows: list[int], positions: list[int]):
            self._names = [order.index(n) for n in rings]
            with group.step("saving ring entries on every rank"):
                _send(group, *wire.ring_message(wire.OP_RING_SAVE, self._names, [*rows, *positions]))
                super().__init__(rings, rows, positions, 0, per_rank)

        def restore(self, keep_below: Optional[list[int]] = None) -> None:
            with group.step("putting back ring entries on every rank"):
                _send(group, *wire.ring_message(wire.OP_RING_RESTORE, self._names, keep_below))
                super().restore(keep_below)

    return MirroredRollback


class BroadcastSpecGraphs:
    """Rank 0's captured speculative steps (spec_decode.graphs.SpecGraphs): each replay reaches
    the other ranks first, as its host arrays and, for a draft or catch-up, the hidden states it
    reads; every rank then replays its own graph of the same bucket (their all-reduces inside)."""

    def __init__(self, graphs, group):
        self.graphs, self.group = graphs, group

    def hidden(self, hb, pool) -> torch.Tensor:
        with self.group.step("a captured speculative verify on rank 0"):
            _send(self.group, *wire.pack_host(hb, wire.OP_SPEC_VERIFY_GRAPH))
            return self.graphs.hidden(hb, pool)

    def draft_hidden(self, hb, prev: torch.Tensor, pool) -> torch.Tensor:
        with self.group.step("a captured speculative draft on rank 0"):
            _send(self.group, *wire.pack_host(hb, wire.OP_SPEC_DRAFT_GRAPH))
            send_hidden(self.group, prev)
            return self.graphs.draft_hidden(hb, prev, pool)

    def catch_up_hidden(self, hb, prev: torch.Tensor, pool) -> torch.Tensor:
        with self.group.step("a captured speculative catch-up on rank 0"):
            _send(self.group, *wire.pack_host(hb, wire.OP_SPEC_CATCH_UP_GRAPH))
            send_hidden(self.group, prev)
            return self.graphs.catch_up_hidden(hb, prev, pool)

    def __getattr__(self, name):
        return getattr(self.graphs, name)


def capture_on_every_rank(spec, pool, group) -> bool:
    """Rank 0, at start-up with --cuda-graph-max-bs: every rank captures the speculator's graph
    sets together (the other ranks' `SpecRank.capture`), agreeing after each bucket; all keep
    them or none. Rank 0's then announce each replay (`BroadcastSpecGraphs`)."""
    held = []

    def capture(agree) -> bool:
        held.append(capture_here(spec, pool, agree))
        return held[-1] is not None

    if group.capture_graphs(spec.runner.cuda_graph_max_bs, capture, "speculative"):
        spec.graphs = BroadcastSpecGraphs(held[0], group)
        return True
    spec.runner.drop_graphs("another rank could not capture its speculative graphs")
    return False


def broadcast_speculator(spec, group, pool) -> None:
    """Make rank 0's speculator send each forward and ring rollback to the other ranks."""
    spec.target = BroadcastTarget(spec.target, group)
    spec.mtp = BroadcastMTP(spec.mtp, group)
    spec.rollback = mirrored_rollback(group, pool.slot_states)


# ---- the other ranks -----------------------------------------------------------------------------


class SpecRank:
    """A rank other than 0: runs the speculator's forwards and ring rollbacks as rank 0 sends
    them, on its own shard of the weights and its own pool."""

    def __init__(self, spec, pool, rank):
        self.spec, self.pool, self.rank = spec, pool, rank
        self.order = sorted(pool.slot_states)
        self.saved: dict[tuple[int, ...], OwnRowsRollback] = {}  # by rings: a later save replaces
        self.graphs = None  # the captured speculative steps, when every rank captured them

    def capture(self, max_bs: int, agree) -> bool:
        """OP_CAPTURE to a speculating rank: its graph sets, with rank 0 and the others (the same
        buckets: rank 0's --cuda-graph-max-bs), or a no at the first bucket when it cannot."""
        self.spec.runner.enable_graphs(max_bs)
        self.graphs = capture_here(self.spec, self.pool, agree)
        return self.graphs is not None

    def _graphs(self):
        if self.graphs is None:
            raise RuntimeError("rank 0 replayed a speculative graph this rank did not capture")
        return self.graphs

    def handle(self, op: int, header: torch.Tensor, payload: torch.Tensor) -> None:
        dev, states = self.spec.runner.device, self.pool.all_states
        if op == wire.OP_SPEC_TARGET:
            self.spec.target.hidden(wire.unpack(header, payload, dev), states)
        elif op == wire.OP_SPEC_MTP:
            fb = wire.unpack(header, payload, dev)
            self.spec.mtp.forward(fb, states, receive_hidden(self.rank, dev))
        elif op == wire.OP_SPEC_VERIFY_GRAPH:
            self._graphs().hidden(wire.unpack_host(header, payload), self.pool)
        elif op == wire.OP_SPEC_DRAFT_GRAPH:
            hb = wire.unpack_host(header, payload)
            self._graphs().draft_hidden(hb, receive_hidden(self.rank, dev), self.pool)
        elif op == wire.OP_SPEC_CATCH_UP_GRAPH:
            hb = wire.unpack_host(header, payload)
            self._graphs().catch_up_hidden(hb, receive_hidden(self.rank, dev), self.pool)
        elif op == wire.OP_RING_SAVE:
            names, ints = wire.unpack_ring(payload)
            n = len(ints) // 2
            rings = {self.order[i]: self.pool.slot_states[self.order[i]] for i in names}
            per_rank = self.pool.num_slots if self.rank.data_parallel else 0
            self.saved[tuple(names)] = OwnRowsRollback(rings, ints[:n], ints[n:], self.rank.shard.rank, per_rank)
        elif op == wire.OP_RING_RESTORE:
            names, keep_below = wire.unpack_ring(payload)
            undo = self.saved.pop(tuple(names), None)
            if undo is None:
                raise RuntimeError("rank 0 put back ring entries this rank never saved")
            undo.restore(keep_below)
        else:
            raise RuntimeError(f"unknown speculative operation {op} from rank 0")
