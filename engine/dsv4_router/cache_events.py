"""What the router's cache index consumes: a worker's cache snapshot and its events, in the
router's own terms.

This is the seam between the engines' KV-events stream (its wire format and the page hash are
defined once, in dsv4_wire, by the KV-continuity work) and the index (cache_index.py). Until that
contract exists the index is built against these types; the subscription client turns each wire
message into one of them (`from_wire`), so a change of the wire format touches only that function.

- A subscription starts with a `CacheSnapshot`: every page hash the engine holds, per tier, as
  of its event `seq`, under the engine's `instance` id (new at every engine start).
- Then `CacheEvent`s, numbered `seq` + 1, + 2, ... within that instance: pages `stored` in a
  tier, `evicted` from it, or the tier (or every tier) `cleared`; a `heartbeat` carries no
  change and says the stream is alive while the cache is idle.

`page_hashes` is the chained hash of a prompt's full pages (a page's hash covers every token
before it): a stand-in with the shape of the engines' definition, to be replaced by the import
of dsv4_wire's once it exists.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from typing import Optional, Sequence

TIERS = ("device", "host", "disk")  # best first: a page found in an earlier tier is cheaper to reuse
KINDS = ("stored", "evicted", "cleared", "heartbeat")


@dataclass(frozen=True)
class CacheEvent:
    instance: str
    seq: int
    kind: str  # one of KINDS
    tier: Optional[str] = None  # for cleared: None = every tier
    hashes: tuple = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown cache event kind {self.kind!r}")
        if self.tier is not None and self.tier not in TIERS:
            raise ValueError(f"unknown cache tier {self.tier!r}")
        if self.kind in ("stored", "evicted") and self.tier is None:
            raise ValueError(f"a {self.kind} event names its tier")


@dataclass(frozen=True)
class CacheSnapshot:
    instance: str
    seq: int  # the last event this snapshot includes; the next event is seq + 1
    pages: dict = field(default_factory=dict)  # tier -> iterable of page hashes


def page_hashes(tokens: Sequence[int], page_size: int, salt: bytes = b"") -> list[bytes]:
    """The chained hashes of the full pages of `tokens` (the last partial page has none)."""
    return chain_hashes(array("I", tokens).tobytes(), page_size, salt)


def chain_hashes(packed: bytes, page_size: int, parent: bytes = b"") -> list[bytes]:
    """`page_hashes` of tokens packed as 4-byte little-endian unsigned ints, continuing a chain
    whose last page hash is `parent` (b"" or the salt: a chain's start)."""
    out: list[bytes] = []
    step = 4 * page_size
    for start in range(0, len(packed) - step + 1, step):
        parent = hashlib.blake2b(parent + packed[start : start + step], digest_size=16).digest()
        out.append(parent)
    return out
