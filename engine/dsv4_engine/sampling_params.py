"""What a request asks of the sampler, and the limits it is checked against.

Plain data, no torch: the HTTP process of `dsv4 serve` validates and sends these without
loading torch (`dsv4_engine.sampling` re-exports them beside the sampler itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from dsv4_engine.structured.spec import StructuredSpec

MAX_LOGPROBS = 20  # most alternatives per token a request may ask for (vLLM's default cap)
MAX_PENALTY = 2.0  # presence/frequency penalties lie in [-2, 2] (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # a logit_bias value lies in [-100, 100] (OpenAI's range)
MAX_LOGIT_BIAS_TOKENS = 1024  # our cap on the entries of one logit_bias map


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
    # Logit processing (dsv4_engine.sampling applies it before temperature, top-k and top-p):
    presence_penalty: float = 0.0  # OpenAI: minus this for every token generated at least once
    frequency_penalty: float = 0.0  # OpenAI: minus this times how often the token was generated
    repetition_penalty: float = 1.0  # vLLM: logits of prompt and generated tokens / (> 0) or * (< 0) it
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens were generated
    # Structured output: the grammar every generated token must follow (None: free text). The
    # engine core compiles it at admission (dsv4_engine.structured); EOS only where it may end.
    structured: Optional[StructuredSpec] = None
    # Not sampling, but per request and carried with it: the prefix cache's namespace (vLLM's
    # cache_salt). Requests with different salts (or one salted, one not) share no cached page.
    cache_salt: Optional[str] = None
    # The conversation this request belongs to (prompt_cache_key / x-session-id), within its
    # cache salt: its cached prefix is pinned for `session_ttl` seconds (None: the engine's) after
    # it gives its pages back (dsv4_engine.session_pins).
    session: Optional[str] = None
    session_ttl: Optional[float] = None

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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (-MAX_PENALTY <= v <= MAX_PENALTY):
                raise ValueError(f"{name} must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g}")
        if not (0 < self.repetition_penalty < float("inf")):
            raise ValueError("repetition_penalty must be a finite number > 0")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias may have at most {MAX_LOGIT_BIAS_TOKENS} entries")
        for tok, bias in self.logit_bias.items():
            if not isinstance(tok, int) or tok < 0:
                raise ValueError(f"logit_bias: {tok!r} is not a token id")
            if not (-MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise ValueError(f"logit_bias values must be between -{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}")
        if self.min_tokens is None or self.min_tokens < 0:
            raise ValueError("min_tokens must be at least 0")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.structured is not None:
            self.structured.check()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the tokens seen so far (counts must be kept)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes this request's logits before sampling (False: the fast path)."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0
