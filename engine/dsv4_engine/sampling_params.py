"""What a request asks of the sampler, and the limits it is checked against.

Plain data, no torch: the HTTP process of `dsv4 serve` validates and sends these without
loading torch (`dsv4_engine.sampling` re-exports them beside the sampler itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

MAX_LOGPROBS = 20  # most alternatives per token a request may ask for (vLLM's default cap)


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
    logprobs: Optional[int] = None  # None: none wanted; N: the sampled token's and the top N

    def validate(self) -> None:
        """Raise ValueError with a user-facing message for parameters we cannot honour."""
        if self.max_tokens is None or self.max_tokens <= 0:
            raise ValueError("max_tokens must be at least 1")
        if not (self.temperature >= 0) or self.temperature == float("inf"):
            raise ValueError("temperature must be a finite number >= 0")
        if not (0 < self.top_p <= 1):
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k is None or self.top_k < -1:
            raise ValueError("top_k must be -1 (disabled) or a positive integer")
        if len(self.stop) > 16 or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be up to 16 non-empty strings")
        if self.seed is not None and not (-(2**63) <= self.seed < 2**63):
            raise ValueError("seed must fit in a signed 64-bit integer")
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
