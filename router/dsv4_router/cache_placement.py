"""Placement by what each engine holds: the router's glue between its workers, the cache index
and the rule (scoring.py). No I/O.

`prompt_ids` is what the router knows of a request's tokens: a prompt given as token ids (the
completions API), or, when the router was given a tokenizer (`tokenize`: the engine's own
renderer and tokenizer, injected by the CLI, which may import them; this package may not), a
text or chat prompt rendered and tokenized as the engine would. Without ids, placement is
today's: rendezvous affinity within a load bound (affinity.py).

`CachePlacement.pick` scores the ready workers of a role whose index entry is fresh (the rest
on load alone, as the rule says), with the router's own count of the tokens it has in flight on
each worker as their load, the session's last worker as the first tie-break, and returns None
when no worker of the role is followed (no events: the caller falls back to affinity).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Optional, Protocol, Sequence

from dsv4_router.cache_events import prompt_hashes
from dsv4_router.cache_index import CacheIndex
from dsv4_router.scoring import NO_MATCH, Candidate, Match, choose

Tokenize = Callable[[str, dict], Optional[list]]  # (path, body) -> prompt token ids, or None
MAX_SESSIONS = 65536  # sessions whose last worker is remembered (least recently used go first)


class _Worker(Protocol):
    url: str
    load_tokens: int


def prompt_ids(path: str, body: dict, tokenize: Optional[Tokenize] = None) -> Optional[list]:
    """The request's prompt as token ids, when the router can know them."""
    if "chat" not in path:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]  # a batch: its first prompt steers the placement
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
    if tokenize is None:
        return None
    try:
        return tokenize(path, body)
    except Exception:  # what the engine will refuse with a 400 is not the router's to judge here
        return None


def _round_down(m: Match, pages: int) -> Match:
    """At most `pages` pages of a match, dropping the worst tiers first (from the tail)."""
    cut = m.pages - pages
    if cut <= 0:
        return m
    disk = max(0, m.disk - cut)
    cut -= m.disk - disk
    host = max(0, m.host - cut)
    cut -= m.host - host
    return Match(max(0, m.device - cut), host, disk)


class CachePlacement:
    def __init__(self, index: CacheIndex, clock: Callable[[], float] = time.monotonic, **rule):
        self.index = index
        self.clock = clock
        self.rule = rule  # costs / load_weight for scoring.choose
        self.last: OrderedDict = OrderedDict()  # session -> the worker its last request went to

    def followed(self, workers: Sequence[_Worker]) -> bool:
        now = self.clock()
        return any(self.index.fresh(w.url, now) for w in workers)

    def matches(self, ids: Sequence[int], salt: Optional[str], workers: Sequence[_Worker]) -> dict[str, Match]:
        """What each fresh worker holds of the prompt (rounded down to the boundary at which a
        prefix resumes there); the others are absent."""
        now = self.clock()
        groups: dict[tuple, list[str]] = {}
        for w in workers:
            if self.index.fresh(w.url, now):
                st = self.index.workers[w.url]
                groups.setdefault((st.page_size, st.boundary_tokens or st.page_size), []).append(w.url)
        out: dict[str, Match] = {}
        for (page, boundary), urls in groups.items():
            if page < 1:
                continue
            chain = prompt_hashes(ids, page, boundary, salt)
            per = max(1, boundary // page)
            for url, m in self.index.match(chain, urls, now).items():
                out[url] = _round_down(m, m.pages // per * per)
        return out

    def pick(
        self,
        workers: Sequence[_Worker],
        ids: Sequence[int],
        salt: Optional[str],
        key: str,
        session: Optional[str] = None,
        held_only: bool = False,
    ) -> Optional[_Worker]:
        """The worker where the prompt costs least; None where no worker is followed, or, with
        `held_only`, where none holds a page of it (the caller's own balance decides then)."""
        if not workers or not self.followed(workers):
            return None
        found = self.matches(ids, salt, workers)
        if held_only and not any(m.pages for m in found.values()):
            return None
        page = next((self.index.workers[u].page_size for u in found), 0) or 1
        cands = [Candidate(w.url, w.load_tokens, found.get(w.url, NO_MATCH), fresh=w.url in found) for w in workers]
        last = self.last.get(session) if session is not None else None
        url = choose(len(ids), page, cands, key=key, last=last, **self.rule)
        if session is not None:
            self.last[session] = url
            self.last.move_to_end(session)
            while len(self.last) > MAX_SESSIONS:
                self.last.popitem(last=False)
        return next(w for w in workers if w.url == url)
