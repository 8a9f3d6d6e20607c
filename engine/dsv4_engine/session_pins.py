"""Sessions: a named conversation's cached prefix is kept for a while after each round.

A request may name its conversation (OpenAI's `prompt_cache_key`, or the `x-session-id`
header); the session is keyed by (tenant, name), the tenant being the request's cache salt (the
router derives it from the API key), so two tenants' sessions of one name are two sessions, and
neither can see nor end the other's. When a named request gives its pages back (it finished, was
preempted or aborted), the chain of cached pages it stood on, from the root to its deepest
cached page, is *pinned* until `ttl` seconds later; the next round of the session renews it.

A pin only changes the order in which idle pages go (`PrefixCache.evict`): unpinned idle pages
first (least recently used leaves, as before), pinned ones only when nothing else is left, so
running work never waits on a pin (a pinned page is idle, hence counted free). A shared system
prefix goes last either way: eviction takes leaves, and a prefix others continue is no leaf.

Bounds: a tenant pins at most `share` of the pool's pages (counting a page its sessions share
once); a pin that would go past it is not made (the session's pages are plain LRU, the session
still known, so DELETE and the next round work as usual). Every pin ends: by its TTL, by
`delete` (DELETE /v1/sessions/{id}), by a new round of the same session (which pins its new
chain), or by eviction under pressure (`dropped`). Pure: the clock is given.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

DEFAULT_TTL_S = 30.0
MAX_TTL_S = 3600.0
DEFAULT_SHARE = 0.5
MAX_SESSION_ID_CHARS = 256

SessionKey = tuple[str, str]  # (tenant: the cache salt or "", the session's name)


def session_key(salt: Optional[str], name: str) -> SessionKey:
    return (salt or "", name)


def check_ttl(ttl: float, cap: float = MAX_TTL_S) -> float:
    """A session TTL in seconds, or ValueError saying the range."""
    if not (0 < ttl <= cap):
        raise ValueError(f"a session TTL is more than 0 and at most {cap:g} seconds, not {ttl:g}")
    return float(ttl)


@dataclass
class _Pin:
    expires: float
    pages: set[int] = field(default_factory=set)


class SessionPins:
    def __init__(
        self,
        total_pages: int,
        ttl: float = DEFAULT_TTL_S,
        share: float = DEFAULT_SHARE,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.total_pages = total_pages
        self.ttl = check_ttl(ttl)
        if not (0 <= share <= 1):
            raise ValueError(f"a tenant's pin share is a fraction of the pool in [0, 1], not {share:g}")
        self.share = share
        self.clock = clock
        self.sessions: dict[SessionKey, _Pin] = {}
        self._by_page: dict[int, set[SessionKey]] = {}  # pinned page -> the sessions pinning it
        self._tenant: dict[str, Counter] = {}  # tenant -> page -> how many of its sessions pin it
        self._expiry: list[tuple[float, int, SessionKey]] = []  # lazily pruned
        self._tie = itertools.count()
        self.pins_made = 0
        self.pins_refused = 0  # past the tenant's share: plain LRU
        self.pages_dropped = 0  # pinned pages taken for running work

    # ---- questions ---------------------------------------------------------------------------

    def holds(self, page: int) -> bool:
        return page in self._by_page

    @property
    def num_pinned(self) -> int:
        return len(self._by_page)

    def tenant_pages(self, tenant: str) -> int:
        return len(self._tenant.get(tenant, ()))

    def cap(self) -> int:
        return int(self.share * self.total_pages)

    # ---- changes -----------------------------------------------------------------------------

    def pin(self, key: SessionKey, pages: Iterable[int], ttl: Optional[float] = None) -> bool:
        """After a round of session `key`: keep these pages (its chain) until now + ttl. False when
        the tenant's share would be exceeded (the session is still known, its pages unpinned)."""
        self.expire()
        self._unpin(key)
        pages = set(pages)
        tenant = key[0]
        held = self._tenant.setdefault(tenant, Counter())
        expires = self.clock() + (self.ttl if ttl is None else ttl)
        pin = self.sessions[key] = _Pin(expires)
        heapq.heappush(self._expiry, (expires, next(self._tie), key))
        if len(held) + len(pages - held.keys()) > self.cap():
            self.pins_refused += 1
            return False
        pin.pages = pages
        for p in pages:
            held[p] += 1
            self._by_page.setdefault(p, set()).add(key)
        self.pins_made += 1
        return True

    def delete(self, key: SessionKey) -> bool:
        """End a session (DELETE); False when this tenant has no session of that name."""
        self.expire()
        if key not in self.sessions:
            return False
        self._unpin(key)
        del self.sessions[key]
        return True

    def dropped(self, page: int) -> None:
        """A pinned page was evicted for running work: no pin holds it any more."""
        for key in self._by_page.pop(page, ()):
            self.sessions[key].pages.discard(page)
            self._release(key[0], page)
        self.pages_dropped += 1

    def expire(self) -> None:
        """End the sessions whose TTL ran out."""
        now = self.clock()
        while self._expiry and self._expiry[0][0] <= now:
            expires, _, key = heapq.heappop(self._expiry)
            pin = self.sessions.get(key)
            if pin is not None and pin.expires == expires:
                self._unpin(key)
                del self.sessions[key]

    def _unpin(self, key: SessionKey) -> None:
        pin = self.sessions.get(key)
        if pin is None:
            return
        for p in pin.pages:
            keys = self._by_page.get(p)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_page[p]
            self._release(key[0], p)
        pin.pages = set()

    def _release(self, tenant: str, page: int) -> None:
        held = self._tenant.get(tenant)
        if held is None:
            return
        held[page] -= 1
        if held[page] <= 0:
            del held[page]
        if not held:
            del self._tenant[tenant]

    def stats(self) -> dict:
        return {
            "sessions": len(self.sessions),
            "pinned_pages": self.num_pinned,
            "ttl_s": self.ttl,
            "tenant_share": self.share,
            "pins_made": self.pins_made,
            "pins_refused": self.pins_refused,
            "pinned_pages_dropped": self.pages_dropped,
        }


def session_refusal(ttl: float, share: float) -> Optional[str]:
    """Why --session-ttl / --session-pin-share cannot be used, in one line, or None."""
    try:
        check_ttl(ttl)
    except ValueError as e:
        return f"--session-ttl: {e}"
    if not (0 <= share <= 1):
        return f"--session-pin-share is a fraction of the pool in [0, 1], not {share:g}"
    return None
