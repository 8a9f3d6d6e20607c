"""PD with data-parallel attention (`--dp-size N`) on either side: which rank's pool a request's
KV is read from and lands in. Pure functions.

At --dp-size N each rank holds only its own requests' pages, in its own pool, and rank 0 keeps
every rank's books in one id space (`parallel.dp_pages`: global page g is local page g mod P of
rank g div P). The KV of one request has the same layout whatever the parallel layout of either
side; what differs is only which pool holds it. So:
- a DP **decode** picks the rank by its load before it registers (`DPPageAllocator.
  allocate_to_receive`), and registers that rank's pool alone: its transport descriptor as `desc`,
  the pages as that pool's local ids, and the rank as `RegisterRoom.decode_dp_rank`. To the
  prefill it is a one-rank decode; the prefill names the rank back in its notification
  (`TransferNote.rank`), which that rank's relay thread hands to rank 0 (`pd.rank_pools`);
- a DP **prefill** reads the request's pages on the rank that computed them: rank 0 asks that
  rank to write its local pages (`pd.dp_sender`), and names it in the notification
  (`TransferNote.prefill_dp_rank`).
A DP side therefore pairs with a TP or single-GPU side, and with another DP side, unchanged.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from dsv4_engine.pd.messages import NAMES_DP_RANK


def locate(pages: list[int], pages_per_rank: int) -> tuple[int, list[int]]:
    """(rank, local page ids) of a request's pages, which all live in one rank's pool."""
    if not pages:
        raise ValueError("a request with no pages lives on no rank")
    rank = pages[0] // pages_per_rank
    if any(p // pages_per_rank != rank for p in pages):
        raise ValueError(f"pages {pages} span ranks (a request's pages all live in one rank's pool)")
    return rank, [p % pages_per_rank for p in pages]


def awaited_ranks(dp_rank: Optional[int], num_ranks: int) -> list[int]:
    """The decode ranks whose notification lands a request: its own rank at --dp-size N (its KV
    lives in that pool alone), every rank under TP (each pool mirrors the whole state)."""
    return [dp_rank] if dp_rank is not None else list(range(num_ranks))


def dp_rank_refusal(answer: Mapping[str, Any]) -> Optional[str]:
    """Why a DP decode cannot use the prefill that gave `answer`, or None: a prefill of an earlier
    release writes the pages but names decode's rank 0 in its notification, and the request
    would wait for its own rank's until the deadline."""
    if answer.get(NAMES_DP_RANK) is not True:
        return (
            "prefill does not name a data-parallel decode's rank in its notification (an earlier release): "
            "run prefill and decode of one release"
        )
    return None
