"""What one engine step produced for one request.

Plain data, no torch: the HTTP process of `dsv4 serve` builds and reads these without loading
torch (`dsv4_engine.sequence` re-exports it beside `Sequence`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class RequestOutput:
    """What one step produced for one request; delivered to the request's sink."""

    rid: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: Optional[str] = None  # stop | length | abort | error
    error: Optional[str] = None
    error_code: int = 500
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # One entry per token in token_ids when the request asked for logprobs (else None):
    # {"token_id": int, "logprob": float, "top": [[token_id, logprob], ...]}.
    logprobs: Optional[list[dict]] = None
    cached_tokens: int = 0  # prompt tokens the prefix cache served (usage.prompt_tokens_details)
