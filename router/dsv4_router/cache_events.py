"""The engines' KV cache events (dsv4_wire.kv_events, the contract) in the terms of the router's
index (cache_index.py): `from_wire` turns one decoded message of an engine's /v1/kv_events
stream into a `CacheSnapshot`, a `CacheEvents` batch or a `Heartbeat`, so a change of the wire
format touches this module only. Page hashes are the contract's (`prompt_hashes`), as hex.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from dsv4_wire import kv_events as wire

TIERS = wire.TIERS  # best first: a page found in an earlier tier is cheaper to reuse


@dataclass(frozen=True)
class Change:
    kind: str  # stored | evicted | cleared
    tier: str
    hashes: tuple = ()


@dataclass(frozen=True)
class CacheEvents:
    """One batch of changes, numbered `seq` (the previous batch's + 1) within `instance`."""

    instance: str
    seq: int
    changes: tuple = ()


@dataclass(frozen=True)
class Heartbeat:
    instance: str
    seq: int  # the last batch sent


@dataclass(frozen=True)
class CacheSnapshot:
    instance: str
    seq: int  # the last batch this snapshot includes; the next is seq + 1
    pages: dict = field(default_factory=dict)  # tier -> iterable of page hashes
    page_size: int = 0
    boundary_tokens: int = 0


Message = Union[CacheSnapshot, CacheEvents, Heartbeat]


class Unreadable(ValueError):
    """A message the router cannot follow (another version, or not the contract): resubscribe."""


def from_wire(msg: dict) -> Message:
    """One message of the stream (already `wire.decode`d) in the index's terms."""
    if msg.get("v") != wire.VERSION:
        raise Unreadable(f"kv events version {msg.get('v')!r}, this router reads {wire.VERSION}")
    kind, instance, seq = msg["type"], msg["instance"], msg["seq"]
    if kind == "snapshot":
        return CacheSnapshot(
            instance,
            seq,
            {t: tuple(hs) for t, hs in msg["tiers"].items()},
            page_size=msg["page_size"],
            boundary_tokens=msg["boundary_tokens"],
        )
    if kind == "heartbeat":
        return Heartbeat(instance, seq)
    return CacheEvents(
        instance, seq, tuple(Change(e["kind"], e["tier"], tuple(e.get("hashes", ()))) for e in msg["events"])
    )


def prompt_hashes(
    tokens: Sequence[int], page_size: int, boundary: Optional[int] = None, salt: Optional[str] = None
) -> list[str]:
    """The contract's hashes of a prompt's pages (those whose key is complete), as the stream
    spells them."""
    return [h.hex() for h in wire.page_hashes(tokens, page_size, boundary, salt)]
