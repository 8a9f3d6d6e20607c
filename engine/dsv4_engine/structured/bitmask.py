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


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """[..., 32*W] bool -> [..., W] int32 bit words (bit k of word w = entry 32*w + k)."""
    bits = allowed.view(*allowed.shape[:-1], -1, 32).to(torch.int64)
    words = (bits << torch.arange(32, dtype=torch.int64)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
