"""Each attention rank's load under `--dp-size N`, for /v1/loads (`dp_ranks`) and /metrics (the
`dp_rank`-labelled series of dsv4_wire.metrics.RANK_GAUGES / RANK_COUNTERS).

Requests wait in the engine's one queue and take a rank when admitted (`dp_cache.choose_rank`),
so only running requests, pages, slot rows (V4) and the prefix cache are per rank.
"""

from __future__ import annotations

from typing import Optional

from dsv4_engine.parallel.dp_pages import DPPageAllocator


def rank_loads(books: DPPageAllocator, running: list, cache=None) -> list[dict]:
    """Per rank: running requests, the pages they hold, what it can hand out, its cache."""
    per_rank = books.running_per_rank(running)
    held = books.held_per_rank()
    out = []
    for r, alloc in enumerate(books.ranks):
        row = {
            "rank": r,
            "running": per_rank[r],
            "kv_pages_held": held[r],  # by requests or the cache
            "kv_pages_used": books.pages_per_rank - alloc.num_free,  # by running requests
            "kv_pages_free": alloc.num_free,
            "kv_pages_total": books.pages_per_rank,
        }
        if books.slots is not None:  # V4's per-request rows on this rank
            row.update(kv_slots_free=books.slots.ranks[r].num_free, kv_slots_total=books.slots.per_rank)
        if cache is not None:
            c = cache.ranks[r]
            row.update(
                kv_pages_cached=c.num_cached,
                prefix_cache_query_tokens=c.query_tokens,
                prefix_cache_hit_tokens=c.hit_tokens,
            )
        out.append(row)
    return out


class RankMetrics:
    """Publishes `rank_loads` as the per-rank series; the hit counter as deltas since last time."""

    def __init__(self):
        self._hits_counted: Optional[list[int]] = None  # None: no series made yet

    def publish(self, m, loads: list[dict]) -> None:
        if self._hits_counted is None:  # every rank's counter exists from the start (0)
            self._hits_counted = [0] * len(loads)
            for row in loads:
                m.inc_rank("dp_rank_prefix_cache_hit_tokens", row["rank"], 0)
        for row in loads:
            r = row["rank"]
            m.set_rank("dp_rank_running_reqs", r, row["running"])
            m.set_rank("dp_rank_kv_pages_used", r, row["kv_pages_used"])
            m.set_rank("dp_rank_kv_pages_free", r, row["kv_pages_free"])
            m.set_rank("dp_rank_prefix_cache_pages", r, row.get("kv_pages_cached", 0))
            hits = row.get("prefix_cache_hit_tokens", 0)
            if hits > self._hits_counted[r]:
                m.inc_rank("dp_rank_prefix_cache_hit_tokens", r, hits - self._hits_counted[r])
                self._hits_counted[r] = hits
