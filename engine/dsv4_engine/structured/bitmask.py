"""The token masks of one sampling step, for the rows that ask for structured output.

Filled on the CPU (xgrammar walks each request's grammar state) while the device is still
running the forward pass that was just launched, into a page-locked buffer, then copied to the
device without waiting; applied there as -inf on every token a row's grammar forbids. Rows
without a grammar are not touched and cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from dsv4_engine.structured.grammar import GrammarError, Matcher


def ensure_matcher(seq) -> Matcher:
    """The request's matcher, built from its compiled grammar and its tokens so far when it has
    none (first use, after preemption freed it, on a PD decode engine)."""
    if seq.matcher is None:
        seq.matcher = Matcher(seq.grammar)
    seq.matcher.sync(seq.output_ids)
    return seq.matcher


def fill_along(
    matcher: Matcher, tokens: Sequence[int], host: torch.Tensor, row0: int, skip: int = 0
) -> tuple[int, int]:
    """Speculation: the masks at the states after tokens[:j], for j = skip .. len(tokens), into
    host rows row0 + j - skip, the matcher advanced over `tokens` on the way and then rolled
    back to where it was (what the request accepts is taken by `ensure_matcher`, once).
    Returns (accepted, filled): how many leading tokens the grammar takes (it stops at the first
    it refuses, and after the one that completes it), and how many rows from row0 hold a mask
    (a state past a refused token or after completion has none: its rows are left as they are)."""
    m, accepted, filled = matcher.m, 0, 0
    try:
        for j in range(len(tokens) + 1):
            if j >= skip:
                if m.is_terminated():
                    break
                m.fill_next_token_bitmask(host, row0 + j - skip)
                filled += 1
            if j == len(tokens) or m.is_terminated() or not m.accept_token(tokens[j]):
                break
            accepted += 1
    finally:
        if accepted:
            m.rollback(accepted)
    return accepted, filled


def bitmask_width(vocab: int) -> int:
    return -(-vocab // 32)


@dataclass
class StepMask:
    rows: list[int]  # rows of the batch that are constrained, in order
    bits: torch.Tensor  # [len(rows), ceil(vocab/32)] int32 on the logits' device: bit t of a row = token t allowed
    may_end: set[int] = field(default_factory=set)  # rows whose grammar admits only a stop token now
    errors: dict[int, Exception] = field(default_factory=dict)  # rows whose grammar state failed (those rows only)


class MaskFiller:
    """A reusable host buffer for the masks of up to `rows` requests."""

    def __init__(self, vocab: int, device: torch.device, stop_ids: Sequence[int] = ()):
        self.vocab, self.device = vocab, torch.device(device)
        self.width = bitmask_width(vocab)
        self._host: Optional[torch.Tensor] = None
        stop = torch.zeros(self.width * 32, dtype=torch.bool)
        stop[[t for t in stop_ids if 0 <= t < vocab]] = True
        self._not_stop = _pack(~stop)  # [width] int32: every bit but the stop tokens'

    def _buffer(self, n: int) -> torch.Tensor:
        if self._host is None or self._host.shape[0] < n:
            rows = max(n, 2 * (self._host.shape[0] if self._host is not None else 4))
            # The previous step's copy out of this buffer has finished: the sampler read its
            # results back to the host (a sync) before this step fills it again.
            self._host = torch.empty((rows, self.width), dtype=torch.int32, pin_memory=self.device.type == "cuda")
        return self._host[:n]

    def fill(self, seqs: Sequence) -> Optional[StepMask]:
        """The mask of each request in `seqs` that has a grammar (`seq.grammar`), or None when
        none has one."""
        rows = [i for i, s in enumerate(seqs) if getattr(s, "grammar", None) is not None]
        if not rows:
            return None
        host = self._buffer(len(rows))
        host.fill_(-1)
        out = StepMask(rows, host)
        for j, i in enumerate(rows):
            seq = seqs[i]
            try:
                ensure_matcher(seq).fill(host, j)
            except (GrammarError, RuntimeError, ValueError) as e:
                out.errors[i] = e  # this row samples unconstrained and is then failed
                continue
            if len(seq.output_ids) < seq.params.min_tokens and not bool((host[j] & self._not_stop).any()):
                out.may_end.add(i)  # the grammar is complete: min_tokens cannot hold its end back
        if self.device.type != "cpu":
            out.bits = host.to(self.device, non_blocking=True)
        else:
            out.bits = host.clone()  # the buffer is refilled next step
        return out

    def fill_chains(self, items: Sequence[tuple]) -> tuple[Optional[StepMask], list[int], list[int]]:
        """Speculation's masks: for each (seq, tokens, skip, row) the masks at the states after
        tokens[:j] (j = skip .. len(tokens), the request's output so far before them) for the
        logits rows row, row + 1, ...; rows of requests without a grammar are left out. Returns
        the mask (None when no request has a grammar), and per item the tokens its grammar
        accepts and the rows it filled (`fill_along`; len(tokens) and every row without a grammar)."""
        accepted = [len(t) for _, t, _, _ in items]
        filled = [len(t) - k + 1 for _, t, k, _ in items]
        mine = [n for n, it in enumerate(items) if getattr(it[0], "grammar", None) is not None]
        if not mine:
            return None, accepted, filled
        host = self._buffer(sum(filled[n] for n in mine))
        host.fill_(-1)  # a row past the grammar's end stays all-allowed: what it picks is never emitted
        out = StepMask([], host)
        at = 0
        for n in mine:
            seq, toks, skip, row = items[n]
            out.rows.extend(range(row, row + filled[n]))
            try:
                accepted[n], filled[n] = fill_along(ensure_matcher(seq), toks, host, at, skip)
            except (GrammarError, RuntimeError, ValueError) as e:
                out.errors[row] = e
                accepted[n], filled[n] = 0, 0
            for j in range(filled[n]):
                short = len(seq.output_ids) + skip + j < seq.params.min_tokens
                if short and not bool((host[at + j] & self._not_stop).any()):
                    out.may_end.add(row + j)
            at += len(toks) - skip + 1
        out.bits = host.to(self.device, non_blocking=True) if self.device.type != "cpu" else host.clone()
        return out, accepted, filled


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """[..., 32*W] bool -> [..., W] int32 bit words (bit k of word w = entry 32*w + k)."""
    bits = allowed.view(*allowed.shape[:-1], -1, 32).to(torch.int64)
    words = (bits << torch.arange(32, dtype=torch.int64)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
