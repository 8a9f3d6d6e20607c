"""Byte caps on what the operator reads from engines and from the API server's pods/log.

An engine is tenant code (any image a DSV4Deployment names): its /metrics, /v1/loads and
/debug/stacks may be endless or huge. Every body is read through :func:`read_capped`, which
stops at the cap and says so, so one engine can neither fill the operator's memory nor keep a
reader busy for longer than its timeout allows.
"""

from __future__ import annotations

from typing import Any

# Sized from what real engines send, with room: our engine's /metrics is ~20 KiB; SGLang with
# 8 TP ranks and its histograms a few hundred KiB.
METRICS_MAX_BYTES = 4 << 20
LOADS_MAX_BYTES = 1 << 20
EVIDENCE_MAX_BYTES = 1 << 20  # /debug/stacks, and each /metrics or /v1/loads copied as evidence
LOG_MAX_BYTES = 256 << 10  # pods/log: also asked of the API server as limitBytes
_CHUNK = 64 << 10


class BodyTooLarge(ValueError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"body larger than {limit} bytes (the operator's cap)")
        self.limit = limit


async def read_capped(resp: Any, limit: int, *, truncate: bool = False) -> bytes:
    """An aiohttp response's body, at most ``limit`` bytes: past it, BodyTooLarge, or with
    ``truncate`` its first ``limit`` bytes.  The rest is never read (the connection is closed)."""
    length = resp.content_length
    if length is not None and length > limit and not truncate:
        raise BodyTooLarge(limit)
    parts: list[bytes] = []
    size = 0
    while True:
        chunk = await resp.content.read(_CHUNK)
        if not chunk:
            return b"".join(parts)
        size += len(chunk)
        if size > limit:
            resp.close()  # drop the connection rather than drain an endless body
            if truncate:
                parts.append(chunk[: len(chunk) - (size - limit)])
                return b"".join(parts)
            raise BodyTooLarge(limit)
        parts.append(chunk)
