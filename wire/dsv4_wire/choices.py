"""The seed of a request's choice j: the engine samples with it, and the router continues a
choice alone (migration) with it, so both must spell it the same."""

from __future__ import annotations

from typing import Optional

INT64_MIN = -(2**63)


def choice_seed(seed: Optional[int], j: int) -> Optional[int]:
    """seed + j, as vLLM gives choice j, wrapped to stay a signed 64-bit integer: each choice draws
    its own reproducible stream, choice 0 the request's. A missing (or non-integer) seed passes
    through unchanged."""
    if seed is None or isinstance(seed, bool) or not isinstance(seed, int):
        return seed
    return (seed + j - INT64_MIN) % 2**64 + INT64_MIN
