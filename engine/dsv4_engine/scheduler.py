"""Continuous batching: which requests run this step and how many of their tokens.

Every step, running requests that are decoding take one token each first (decode latency is
what users feel), then chunked prefills continue and waiting requests are admitted FCFS while
the token budget, the request limit and free pages allow. When pages run out, the newest
running request is preempted: its pages (and slot row) are freed and it is recomputed later from
position 0 (a model's slot state, e.g. V4's window ring, cannot be rewound, so nothing is kept).

A model with slot states (`KVPool.slots`) gets a row per request at admission, with its first
pages; finish, abort, failure and preemption give it back through `release`.

With a prefix cache, a request admitted with nothing computed first takes the pages of its
longest cached prefix (shared, reference-counted) and starts computing after them; `release`
drops its references, so preemption, abort and failure never free a page another request uses.
The other choices of an n > 1 request wait for the first one's prompt pages (`_held`), so they
reuse them instead of computing the same prompt side by side.
For a model with slot states the cache resumes only at boundaries where it kept a snapshot of a
slot row. When the model writes snapshots inside a chunk (V4's torch path), the step reserves
their rows (`ScheduledSeq.snapshots`); otherwise a prefill chunk that would cross a prompt's
branch point or last boundary ends there, so the row can be copied after the step (one extra,
short step per prompt).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from typing import Callable, Optional

from dsv4_engine.kv_cache import PageAllocator, SlotAllocator
from dsv4_engine.prefix_cache import PrefixCache
from dsv4_engine.sequence import Sequence, SeqStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int  # tokens of this request computed this step
    # prefix-cache snapshots the forward writes inside this chunk: (position, reserved row)
    snapshots: list[tuple[int, int]] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the request's last known token (so a new one is sampled)."""
        return self.seq.num_computed + self.num_new == self.seq.num_tokens


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        slots: Optional[SlotAllocator] = None,
        prefix_cache: Optional[PrefixCache] = None,
    ):
        self.allocator = allocator
        self.cache = prefix_cache
        self.slots = slots
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Speculative decoding: how many drafted tokens a decoding request verifies besides its
        # last token (dsv4_engine.spec_decode); None without speculation.
        self.lookahead: Optional[Callable[[Sequence], int]] = None

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A request whose KV is already in its pages (PD decode after the transfer)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a request out of the queues (finish/abort); the caller frees its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def release(self, seq: Sequence) -> None:
        """Give back everything the request holds in the pool (pages, slot row); idempotent."""
        if seq.pages:
            pages, seq.pages = seq.pages, []
            self.allocator.free(pages)
        if self.cache is not None:
            self.cache.forget(seq)
        if seq.slot is not None:
            slot, seq.slot = seq.slot, None
            if self.slots is not None:
                self.slots.free(slot)

    def computed(self, seq: Sequence, sched: Optional[ScheduledSeq] = None) -> None:
        """After a step: the request's newly full pages (and, at boundaries, snapshots of its
        slot row) become reusable by others."""
        taken, sched_snaps = (sched.snapshots, []) if sched is not None else ([], None)
        if sched is not None:
            sched.snapshots = sched_snaps
        if self.cache is not None and not seq.finished:
            self.cache.insert(seq)
            if taken:
                self.cache.link_snapshots(seq, taken)
            self.cache.snapshot_due(seq)
        else:
            for _, snap in taken:
                self.cache.snapshots.release(snap)

    def settle(self, batch: list[ScheduledSeq]) -> None:
        """After a step, whatever happened: snapshots reserved for a request whose step never
        reached `computed` (its forward failed) go back."""
        for b in batch:
            for _, snap in b.snapshots:
                self.cache.snapshots.release(snap)
            b.snapshots = []

    def _reserve_snapshots(self, batch: list[ScheduledSeq]) -> None:
        """Rows for the snapshots the forward writes inside this step's chunks."""
        pool = self.cache.snapshots if self.cache is not None else None
        if pool is None or not self.cache.in_forward:
            return
        for b in batch:
            for pos in self.cache.snapshot_points(b.seq, b.num_new):
                if pool.num_free + pool.num_used == 0:
                    return  # every row is reserved by this step already
                b.snapshots.append((pos, pool.reserve()))

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of this request to compute this step: what is left, within the budget, ending
        at the cache's snapshot boundary when the chunk would cross it."""
        n = seq.num_tokens - seq.num_computed
        if n == 1 and self.lookahead is not None:  # speculative decoding: the drafts ride along
            n += self.lookahead(seq)
        n = min(n, budget)
        stop = self.cache.snapshot_stop(seq) if self.cache is not None and n > 1 else None
        if stop is not None and seq.num_computed < stop < seq.num_computed + n:
            n = stop - seq.num_computed
        return n

    def _pages_needed(self, seq: Sequence, upto_tokens: int) -> int:
        return max(0, -(-upto_tokens // self.page_size) - len(seq.pages))

    def _grow(self, seq: Sequence, upto_tokens: int) -> bool:
        need = self._pages_needed(seq, upto_tokens)
        if need == 0:
            return True
        pages = self.allocator.allocate_beside(seq.pages, need)
        if pages is None:
            return False
        seq.pages.extend(pages)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release(seq)
        seq.num_computed = 0
        seq.matcher = None  # grammar state is rebuilt from the output so far when it resumes
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def _held(self, seq: Sequence) -> bool:
        """Whether a choice of an n > 1 request waits for its first choice (`prefix_leader`) to
        compute the prompt's full pages, which it then takes from the prefix cache: the prompt is
        prefilled once, and each other choice computes only the prompt's tail (the tokens after
        its last full page before the last token). Other requests are admitted past it."""
        lead = seq.prefix_leader
        if self.cache is None or lead is None or lead.finished or seq.pages or seq.num_computed:
            return False
        shared = (len(seq.prompt_ids) - 1) // self.page_size * self.page_size
        return lead.num_computed < shared

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        # Decoding requests first, then running chunked prefills, both in admission order.
        order = sorted(self.running, key=lambda s: s.num_tokens - s.num_computed > 1)
        for seq in order:
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._chunk(seq, budget)
            if n <= 0:
                continue
            while not self._grow(seq, seq.num_computed + n):
                victim = next(
                    (
                        s
                        for s in reversed(self.running)
                        if s is not seq
                        and all(b.seq is not s for b in batch)
                        and self.allocator.same_pool(s.pages, seq.pages)
                    ),
                    None,
                )
                if victim is None:
                    self._preempt(seq)
                    break
                self._preempt(victim)
            if seq.status is SeqStatus.RUNNING:
                batch.append(ScheduledSeq(seq, n))
                budget -= n
        i = 0  # the first waiting request not held back (see _held)
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            if self._held(seq):
                i += 1
                continue
            if self.slots is not None and seq.slot is None and not self.slots.follows_pages:
                seq.slot = self.slots.allocate()
                if seq.slot is None:
                    break  # every row is held (only when something else holds rows beyond max_num_seqs)
            hit = self.cache.attach(seq) if self.cache is not None and not seq.pages and seq.num_computed == 0 else None
            n = self._chunk(seq, budget)
            grown = self._grow(seq, seq.num_computed + n)
            if grown and self.slots is not None and seq.slot is None:  # --dp-size: a row on its pages' rank
                seq.slot = self.slots.allocate_beside(seq.pages)
                grown = seq.slot is not None
            if not grown:
                self.release(seq)  # nothing computed yet: its row (and any pages) go back
                if hit is not None:
                    seq.num_computed = 0  # the reused prefix went back with its pages
                break  # FCFS: later requests wait behind it
            if hit is not None:
                self.cache.count(seq.num_tokens, hit)
                seq.num_cached_tokens = hit
            del self.waiting[i]
            seq.prefix_leader = None  # admitted: its prefix is taken (or computed) by now
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        self._reserve_snapshots(batch)
        return batch
