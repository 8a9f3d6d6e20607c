"""`--transfer-checksum`: prefill sums what it sends, region by region; decode sums what landed
and compares, so a transfer that delivered other bytes fails its request instead of decoding
from garbage.

The sum is over the region's bytes read as 32-bit words (16- or 8-bit when the size asks):
one plain sum and one weighted by position (so swapped or shifted words count too), taken
modulo 2^64. Integer addition modulo 2^64 does not depend on the order it runs in, so a CPU
and a GPU side agree. It runs where the state lives (no copy to the host), one gather
and three passes over the request's bytes; it is not a cryptographic hash, only a guard
against bytes that were lost, shifted or flipped on the way.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

from dsv4_engine.pd.transport import PoolStates

_MASK = (1 << 64) - 1
_CHUNK = 1 << 16  # words summed at a time
_positions: dict[torch.device, torch.Tensor] = {}


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """1, 2, ..., n as int64 on `device` (one growing tensor per device, sliced)."""
    w = _positions.get(device)
    if w is None or w.numel() < n:
        w = torch.arange(1, max(n, 1 << 16) + 1, dtype=torch.int64, device=device)
        _positions[device] = w
    return w[:n]


def _words(t: torch.Tensor) -> torch.Tensor:
    b = t.contiguous().view(-1).view(torch.uint8)
    n = b.numel()
    return b.view(torch.int32) if n % 4 == 0 else b.view(torch.int16) if n % 2 == 0 else b


def units_checksum(units: Sequence[torch.Tensor]) -> str:
    """A 32-hex-digit checksum of the bytes of `units` laid end to end (see the module
    docstring). On the CPU each unit is summed in chunks that stay in cache (no big int64
    copies); on a GPU they are joined and summed in one pass (one sync)."""
    if units and units[0].device.type != "cpu":
        units = [torch.cat([_words(u) for u in units])]
    plain = weighted = offset = 0
    for u in units:
        words = _words(u)
        chunk = max(1, _CHUNK if words.device.type == "cpu" else words.numel())
        weights = _weights(min(words.numel(), chunk), words.device)
        for start in range(0, words.numel(), chunk):
            w = words[start : start + chunk].to(torch.int64)
            total = int(w.sum())
            plain += total
            # positions offset+start+1, offset+start+2, ...
            weighted += int((w * weights[: w.numel()]).sum()) + (offset + start) * total
        offset += words.numel()
    return f"{plain & _MASK:016x}{weighted & _MASK:016x}"


def tensor_checksum(t: torch.Tensor) -> str:
    """The checksum of one tensor's bytes."""
    return units_checksum([t])


def region_checksums(pool: PoolStates, pages: Sequence[int], slot: Optional[int]) -> dict[str, str]:
    """The checksum of each region's part of one request: its `pages` (in that order) in every
    paged region, its `slot` row in every slot region."""
    idx = torch.as_tensor(list(pages), dtype=torch.long)
    out = {}
    for name, t in pool.pages.items():
        # gather a cache-sized group of pages at a time (all at once on a GPU)
        per = len(pages) if t.device.type != "cpu" else max(1, _CHUNK * 4 // (t[0].numel() * t.element_size()))
        out[name] = units_checksum([t[idx[i : i + per].to(t.device)] for i in range(0, len(pages), per)])
    if slot is not None:
        for name, t in pool.slots.items():
            out[name] = units_checksum([t[slot]])
    return out


def checksum_mismatch(sent: Mapping[str, str], landed: Mapping[str, str]) -> Optional[str]:
    """Which regions landed other bytes than were sent (one line), or None."""
    if set(sent) != set(landed):
        return f"checksummed regions differ: sent {sorted(sent)}, landed {sorted(landed)}"
    bad = [name for name in sent if sent[name] != landed[name]]
    if bad:
        return (
            f"KV transfer checksum mismatch in region(s) {', '.join(bad)}: the bytes that landed are not the bytes sent"
        )
    return None
