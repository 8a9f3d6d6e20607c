"""The n choices of one request, pure: each sequence's PD bootstrap room, and best_of's pick."""

from __future__ import annotations

import hashlib


def choice_room(room: int, index: int) -> int:
    """PD: the bootstrap room of a request's sequence `index` (n > 1, several prompts). The router
    names one room; prefill and decode both derive the same one per sequence from it, so each
    sequence has its own hand-off. Sequence 0 keeps the router's room."""
    if index == 0:
        return room
    digest = hashlib.blake2b(f"{room}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # [0, 2^63), as the router's rooms


def best_choices(cumulative: list[float], n: int) -> list[int]:
    """best_of: the indexes of the n candidates with the highest cumulative logprob of their
    sampled tokens (vLLM's ranking), best first; ties keep the candidates' order."""
    return sorted(range(len(cumulative)), key=lambda c: -cumulative[c])[:n]
