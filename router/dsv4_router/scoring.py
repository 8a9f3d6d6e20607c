"""Which engine should take a prompt: the one where it costs least, counting both what the
engine already holds of it and how busy the engine is. Pure functions; the router (and the
simulator, bench.suites.route_sim) feed them.

The cost of a prompt on a candidate, in tokens of work:

    cost = uncached + load_weight * load

- `uncached`: the prompt's tokens the candidate must compute: every token past the longest
  prefix of the prompt it holds, plus, for the pages of that prefix, a fraction of a page by the
  tier that holds it (device 0, host `TierCosts.host`, disk `TierCosts.disk`: bringing a page
  back is cheaper than computing it, not free). The last token is always computed (there must
  be logits to sample).
- `load`: the candidate's running and queued tokens (what it has in hand: prompt tokens waiting
  to be prefilled, contexts being decoded).
- `load_weight` (default `LOAD_WEIGHT`, 1/32) is the exchange rate: a session leaves the engine
  holding its prefix only when that engine carries 32 tokens of load more per token the move
  would recompute. At 1 (the shape of Dynamo's default cost) ordinary load swings (a few long
  contexts decoding at once) pull sessions off their caches. In the simulator (bench.suites.
  route_sim, 8 engines, chat mix) reuse was 0.65x the one-shared-cache oracle's at weight 1,
  0.93x at 1/10, 0.97x at 1/32 and 0.99x at 1/100, engine loads 1.01, 1.01, 1.04 and 1.19
  max/mean; with no load term at all hot spots form. bench/results/route_sim has the sweep.
- A candidate whose cache events are stale (`fresh` false) is scored on load alone: its claims
  are not trusted, the prompt counts as wholly uncached there.

The cheapest wins. Costs within `tie_tokens` of the cheapest are a tie, broken by the session's
last worker (a named conversation stays where it was while that costs nothing), then by
rendezvous hashing of the request's key, so every router replica that sees the same index and
loads picks the same engine without talking to the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from dsv4_router.affinity import preference

LOAD_WEIGHT = 1 / 32


@dataclass(frozen=True)
class Match:
    """How much of a prompt's page chain a worker holds: the pages of the longest held prefix,
    counted by the best tier holding each."""

    device: int = 0
    host: int = 0
    disk: int = 0

    @property
    def pages(self) -> int:
        return self.device + self.host + self.disk


NO_MATCH = Match()


@dataclass(frozen=True)
class TierCosts:
    """The cost of reusing one page, as a fraction of computing it, per tier (device: 0)."""

    host: float = 0.1
    disk: float = 0.3


@dataclass(frozen=True)
class Candidate:
    url: str
    load_tokens: float  # running + queued tokens
    match: Match = NO_MATCH
    fresh: bool = True  # its cache events are current; False: load-only


def uncached_tokens(prompt_tokens: int, page_size: int, match: Match, costs: TierCosts = TierCosts()) -> float:
    """The work of a prompt on a worker holding `match` of it, in tokens."""
    if prompt_tokens <= 0:
        return 0.0
    reusable = min(match.pages * page_size, prompt_tokens - 1)
    pages = reusable / page_size if page_size else 0.0
    # charge the tiers best first over the reusable pages (the device prefix is the front)
    device = min(pages, match.device)
    host = min(pages - device, match.host)
    disk = pages - device - host
    return (prompt_tokens - reusable) + page_size * (host * costs.host + disk * costs.disk)


def costs_of(
    prompt_tokens: int,
    page_size: int,
    candidates: Sequence[Candidate],
    costs: TierCosts = TierCosts(),
    load_weight: float = LOAD_WEIGHT,
) -> dict[str, float]:
    return {
        c.url: uncached_tokens(prompt_tokens, page_size, c.match if c.fresh else NO_MATCH, costs)
        + load_weight * c.load_tokens
        for c in candidates
    }


def choose(
    prompt_tokens: int,
    page_size: int,
    candidates: Sequence[Candidate],
    key: str = "",
    last: Optional[str] = None,
    costs: TierCosts = TierCosts(),
    load_weight: float = LOAD_WEIGHT,
    tie_tokens: Optional[float] = None,
) -> str:
    """The url of the cheapest candidate (see the module's doc for the rule and its ties)."""
    if not candidates:
        raise ValueError("no worker to choose from")
    cost = costs_of(prompt_tokens, page_size, candidates, costs, load_weight)
    best = min(cost.values())
    slack = page_size if tie_tokens is None else tie_tokens
    tied = [u for u, c in cost.items() if c <= best + slack]
    if last is not None and last in tied:
        return last
    if len(tied) == 1:
        return tied[0]
    return preference(key, tied)[0]
