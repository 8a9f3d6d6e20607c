"""Reading an engine's Prometheus text: a histogram or counter before and after a run, and what
changed in between (pure functions; the scrape itself is one GET)."""

from __future__ import annotations

import math
from typing import Optional

import httpx
from prometheus_client.parser import text_string_to_metric_families


def histogram(text: str, name: str) -> dict:
    """{"sum", "count", "buckets": [(le, cumulative count), ...]} summed over label sets."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    for fam in text_string_to_metric_families(text):
        if fam.name != name:
            continue
        for s in fam.samples:
            if s.name == name + "_bucket":
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
            elif s.name == name + "_sum":
                total += s.value
            elif s.name == name + "_count":
                count += s.value
    return {"sum": total, "count": count, "buckets": sorted(buckets.items())}


def counter(text: str, name: str) -> float:
    """The samples named `name` (e.g. x_total), summed over label sets, whatever family the
    parser filed them under (that depends on how the TYPE line names the counter)."""
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


def histogram_delta(before: dict, after: dict) -> dict:
    b = dict(before["buckets"])
    return {
        "sum": after["sum"] - before["sum"],
        "count": after["count"] - before["count"],
        "buckets": [(le, c - b.get(le, 0.0)) for le, c in after["buckets"]],
    }


def bucket_quantile(buckets: list[tuple[float, float]], q: float) -> Optional[float]:
    """Prometheus' histogram_quantile: linear inside the bucket holding rank q * count."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if math.isinf(le):
                return prev_le  # beyond the last finite bound: the bound is all we know
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return prev_le


def scrape(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text
