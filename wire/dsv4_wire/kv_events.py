"""KV cache events: what an engine's cache gained and lost, per tier, for a router to follow.

The contract, spelled once (docs/design.md, "KV cache events", is its prose twin):

**Page hash.** A cached page is named by a 128-bit hash chained over everything before it, so
equal hashes mean equal prefixes (up to a 2^-128 collision: a router's guess, never the KV an
engine hands out; engines key their own caches on the tokens themselves)::

    root      = blake2b(b"dsv4-kv-v1\\0" + salt.encode("utf-8"), digest_size=16)   # salt "" if none
    hash(i)   = blake2b(hash(i-1) + pack("<{n}I", *key_tokens(i)), digest_size=16)  # hash(-1) = root

`salt` is the request's cache namespace: its `cache_salt` (which the router derives from the
API key under `--cache-salt-from-api-key`), or none (the shared namespace). `key_tokens(i)` are
the tokens of page i, ``tokens[i*P : (i+1)*P]`` for a page size P; a model whose pages are final
only at coarser *boundaries* (DeepSeek-V4: lcm of the page size and every compression window)
keys page i on its tokens and every later one up to the next boundary,
``tokens[i*P : (floor(i*P / B) + 1) * B]``, exactly as the engine's prefix cache keys it. Only
pages whose key is complete have a hash (the engine caches nothing else). Hashes travel as 32
lowercase hex digits.

**Stream.** ``GET /v1/kv_events`` (Paths.KV_EVENTS) answers newline-delimited JSON
(`application/x-ndjson`), one message a line, behind the PD secret when one is set (it is an
engine-to-router surface). Every message has ``v`` (VERSION), ``type`` and ``instance`` (the
engine process's id: a new one after every start) and ``seq``:

- ``snapshot``: first message of every subscription: what the engine holds now, per tier
  (``tiers``: tier -> list of hashes), with ``model``, ``role``, ``page_size``,
  ``boundary_tokens`` (the resume granularity: a prefix is reusable at multiples of it) and
  ``hash`` (HASH_ALGO). Its ``seq`` is that of the last ``events`` message folded into it.
- ``events``: one batch of changes, ``seq`` one more than the previous message's, ``ts`` (unix
  seconds), ``events``: a list of ``{"kind": "stored" | "evicted", "tier": T, "hashes": [...]}``
  or ``{"kind": "cleared", "tier": T}`` (every page of that tier is gone). A page moving down a
  tier is ``evicted`` from one and ``stored`` in the other; a page can be held in more than one
  tier at once.
- ``heartbeat``: nothing changed; ``seq`` is the last ``events`` message's (sent every few
  seconds so a subscriber can tell a quiet engine from a dead stream).

**Rules for a subscriber.** Key what you learn by ``instance``; a message with another instance,
a ``v`` you do not know, or an ``events`` ``seq`` that is not the previous one plus one means you
missed something: drop what you know of that engine and subscribe again (a fresh snapshot). The
engine closes a subscription that falls too far behind; reconnecting is the same resync. An
engine that starts publishes ``cleared`` for every tier as its first ``events`` message.

Tiers: ``device`` (the pool the model reads), ``host`` (host memory, `--host-cache-gb`), ``disk``
(`--disk-cache-dir`).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

VERSION = 1
HASH_ALGO = "blake2b-128-chain-v1"
CONTENT_TYPE = "application/x-ndjson"
TIERS = ("device", "host", "disk")
KINDS = ("stored", "evicted", "cleared")
TYPES = ("snapshot", "events", "heartbeat")
HEARTBEAT_S = 5.0  # a quiet stream still says so this often

_DOMAIN = b"dsv4-kv-v1\0"
_MAX_TOKEN = 0xFFFFFFFF


def root_hash(salt: Optional[str] = None) -> bytes:
    """The chain's start for a cache namespace (a request's cache_salt; None or "": shared)."""
    return hashlib.blake2b(_DOMAIN + (salt or "").encode("utf-8"), digest_size=16).digest()


def chain_hash(parent: bytes, key_tokens: Sequence[int]) -> bytes:
    """The hash of a page from its parent's hash (root_hash for the first) and its key tokens."""
    if any(t < 0 or t > _MAX_TOKEN for t in key_tokens):
        raise ValueError("token ids must fit in 32 bits")
    return hashlib.blake2b(parent + struct.pack(f"<{len(key_tokens)}I", *key_tokens), digest_size=16).digest()


def key_span(i: int, page_size: int, boundary: Optional[int] = None) -> tuple[int, int]:
    """Token range [start, end) that page i's key covers: the page, and with a boundary longer
    than a page every later token up to the next boundary."""
    b = boundary or page_size
    if page_size < 1 or b % page_size:
        raise ValueError(f"boundary {b} is not a multiple of the page size {page_size}")
    start = i * page_size
    return start, (start // b + 1) * b


def page_hashes(
    tokens: Sequence[int], page_size: int, boundary: Optional[int] = None, salt: Optional[str] = None
) -> list[bytes]:
    """The hashes of every page of this token sequence whose key is complete, in order."""
    b = boundary or page_size
    usable = len(tokens) // b * b // page_size
    out, h = [], root_hash(salt)
    for i in range(usable):
        s, e = key_span(i, page_size, b)
        h = chain_hash(h, tokens[s:e])
        out.append(h)
    return out


def hex_hash(h: bytes) -> str:
    return h.hex()


def _check_hash(h) -> str:
    if not isinstance(h, str) or len(h) != 32 or any(c not in "0123456789abcdef" for c in h):
        raise ValueError(f"a page hash is 32 lowercase hex digits, not {h!r:.60}")
    return h


def _check_tier(t) -> str:
    if t not in TIERS:
        raise ValueError(f"unknown tier {t!r}; known: {', '.join(TIERS)}")
    return t


@dataclass(frozen=True)
class Event:
    kind: str  # stored | evicted | cleared
    tier: str
    hashes: tuple[str, ...] = ()

    def to_json(self) -> dict:
        if self.kind == "cleared":
            return {"kind": "cleared", "tier": self.tier}
        return {"kind": self.kind, "tier": self.tier, "hashes": list(self.hashes)}


def snapshot_message(
    instance: str,
    seq: int,
    tiers: dict[str, Iterable[str]],
    *,
    model: str,
    role: str,
    page_size: int,
    boundary_tokens: int,
) -> dict:
    return {
        "v": VERSION,
        "type": "snapshot",
        "instance": instance,
        "seq": seq,
        "model": model,
        "role": role,
        "page_size": page_size,
        "boundary_tokens": boundary_tokens,
        "hash": HASH_ALGO,
        "tiers": {t: sorted(tiers.get(t, ())) for t in TIERS},
    }


def events_message(instance: str, seq: int, events: Iterable[Event], ts: float) -> dict:
    return {
        "v": VERSION,
        "type": "events",
        "instance": instance,
        "seq": seq,
        "ts": ts,
        "events": [e.to_json() for e in events],
    }


def heartbeat_message(instance: str, seq: int) -> dict:
    return {"v": VERSION, "type": "heartbeat", "instance": instance, "seq": seq}


def encode(msg: dict) -> bytes:
    """One message as one line of the stream."""
    return json.dumps(msg, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes | str) -> dict:
    """A line of the stream, checked against the contract (ValueError otherwise). A message of
    another version is returned as is, for the subscriber to resync on (see the rules above)."""
    try:
        msg = json.loads(line)
    except ValueError as e:
        raise ValueError(f"not a JSON line: {e}") from None
    if not isinstance(msg, dict):
        raise ValueError("a message is a JSON object")
    if msg.get("v") != VERSION:
        return msg
    kind = msg.get("type")
    if kind not in TYPES:
        raise ValueError(f"unknown message type {kind!r}")
    if not isinstance(msg.get("instance"), str) or not msg["instance"]:
        raise ValueError("a message names its engine instance")
    if not isinstance(msg.get("seq"), int) or msg["seq"] < 0:
        raise ValueError("seq is an integer >= 0")
    if kind == "snapshot":
        tiers = msg.get("tiers")
        if not isinstance(tiers, dict):
            raise ValueError("a snapshot carries its tiers")
        for t, hs in tiers.items():
            _check_tier(t)
            if not isinstance(hs, list):
                raise ValueError(f"tier {t}: a list of hashes")
            for h in hs:
                _check_hash(h)
        for k in ("page_size", "boundary_tokens"):
            if not isinstance(msg.get(k), int) or msg[k] < 1:
                raise ValueError(f"{k} is a positive integer")
    elif kind == "events":
        evs = msg.get("events")
        if not isinstance(evs, list):
            raise ValueError("events is a list")
        for e in evs:
            if not isinstance(e, dict) or e.get("kind") not in KINDS:
                raise ValueError(f"unknown event {e!r:.80}")
            _check_tier(e.get("tier"))
            if e["kind"] != "cleared":
                if not isinstance(e.get("hashes"), list):
                    raise ValueError(f"a {e['kind']} event lists its hashes")
                for h in e["hashes"]:
                    _check_hash(h)
    return msg


@dataclass
class EngineView:
    """What one engine holds, as its stream tells it: the reference semantics of the messages
    (a subscriber may keep a richer index; it must agree with this one)."""

    instance: Optional[str] = None
    seq: int = -1
    page_size: int = 0
    boundary_tokens: int = 0
    tiers: dict[str, set[str]] = field(default_factory=lambda: {t: set() for t in TIERS})

    def apply(self, msg: dict) -> bool:
        """Fold one decoded message in; False when the subscriber must drop this view and
        subscribe again (another instance or version, or a message missed)."""
        if msg.get("v") != VERSION:
            return False
        if msg["type"] == "snapshot":
            self.instance, self.seq = msg["instance"], msg["seq"]
            self.page_size, self.boundary_tokens = msg["page_size"], msg["boundary_tokens"]
            self.tiers = {t: set(msg["tiers"].get(t, ())) for t in TIERS}
            return True
        if self.instance is None or msg["instance"] != self.instance:
            return False
        if msg["type"] == "heartbeat":
            return msg["seq"] == self.seq
        if msg["seq"] != self.seq + 1:
            return False
        self.seq = msg["seq"]
        for e in msg["events"]:
            held = self.tiers[e["tier"]]
            if e["kind"] == "stored":
                held.update(e["hashes"])
            elif e["kind"] == "evicted":
                held.difference_update(e["hashes"])
            else:
                held.clear()
        return True

    def holds(self, h: str) -> Optional[str]:
        """The highest tier holding this page, or None."""
        return next((t for t in TIERS if h in self.tiers[t]), None)

    def matched_pages(self, hashes: Sequence[str]) -> int:
        """How many leading pages of a request (its page hashes, in order) this engine holds in
        some tier; a router rounds it down to `boundary_tokens`."""
        n = 0
        for h in hashes:
            if self.holds(h) is None:
                break
            n += 1
        return n
