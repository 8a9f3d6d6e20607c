"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> None:
        """Raise ValueError with a user-facing message for parameters we cannot honour."""
        if self.max_tokens is None or self.max_tokens <= 0:
            raise ValueError("max_tokens must be at least 1")
        if not (self.temperature >= 0):
            raise ValueError("temperature must be >= 0")
        if not (0 < self.top_p <= 1):
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k is None or self.top_k < -1:
            raise ValueError("top_k must be -1 (disabled) or a positive integer")
        if len(self.stop) > 16 or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be up to 16 non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[Optional[torch.Generator]]) -> list[int]:
    """One token per row of fp32 logits [B, V]."""
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k and p.top_k > 0:
            kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_p, dim=-1)
            drop = cum - sorted_p > p.top_p  # keep the smallest prefix whose mass reaches top_p
            sorted_p[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out
