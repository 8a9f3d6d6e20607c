"""`--transfer-checksum`: prefill sums what it sends, region by region; decode sums what landed
and compares, so a transfer that delivered other bytes fails its request instead of decoding
from garbage.

The sum is over the region's bytes read as 32-bit words (16- or 8-bit when the size asks):
one plain sum and one weighted by position (so swapped or shifted words count too), both in
int64 with wrap-around. Integer addition modulo 2^64 does not depend on the order it runs in,
so a CPU and a GPU side agree. It runs where the state lives (no copy to the host), one gather
and three passes over the request's bytes; it is not a cryptographic hash, only a guard
against bytes that were lost, shifted or flipped on the way.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

from dsv4_engine.pd.transport import PoolStates

_MASK = (1 << 64) - 1
_positions: dict[torch.device, torch.Tensor] = {}


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """1, 2, ..., n as int64 on `device` (one growing tensor per device, sliced)."""
    w = _positions.get(device)
    if w is None or w.numel() < n:
        w = torch.arange(1, max(n, 1 << 16) + 1, dtype=torch.int64, device=device)
        _positions[device] = w
    return w[:n]


def tensor_checksum(t: torch.Tensor) -> str:
    """A 32-hex-digit checksum of a tensor's bytes (see the module docstring)."""
    b = t.contiguous().view(-1).view(torch.uint8)
    n = b.numel()
    words = b.view(torch.int32) if n % 4 == 0 else b.view(torch.int16) if n % 2 == 0 else b
    w = words.to(torch.int64)
    plain = int(w.sum()) & _MASK
    weighted = int((w * _weights(w.numel(), w.device)).sum()) & _MASK
    return f"{plain:016x}{weighted:016x}"


def region_checksums(pool: PoolStates, pages: Sequence[int], slot: Optional[int]) -> dict[str, str]:
    """The checksum of each region's part of one request: its `pages` (in that order) in every
    paged region, its `slot` row in every slot region."""
    idx = torch.as_tensor(list(pages), dtype=torch.long)
    out = {}
    for name, t in pool.pages.items():
        out[name] = tensor_checksum(t[idx.to(t.device)])
    if slot is not None:
        for name, t in pool.slots.items():
            out[name] = tensor_checksum(t[slot])
    return out


def checksum_mismatch(sent: Mapping[str, str], landed: Mapping[str, str]) -> Optional[str]:
    """Which regions landed other bytes than were sent (one line), or None."""
    if set(sent) != set(landed):
        return f"checksummed regions differ: sent {sorted(sent)}, landed {sorted(landed)}"
    bad = [name for name in sent if sent[name] != landed[name]]
    if bad:
        return f"KV transfer checksum mismatch in region(s) {', '.join(bad)}: the bytes that landed are not the bytes sent"
    return None
