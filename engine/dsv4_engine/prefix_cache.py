"""Prefix caching: a request reuses the KV pages of the longest cached prefix of its tokens.

The cache is a radix tree at page granularity: each node is one full page of KV, keyed under
its parent by the exact token ids of that page, so a path from the root spells a prefix and
holds its pages. Why a tree and not hashed page chains (vLLM's choice): the key compares the
tokens themselves (no hash collision can ever hand a request another prompt's KV), a lookup
walks one dict per page, and eviction takes leaves only, so every cached chain stays reachable
from the root and nothing is orphaned.

Pages are reference-counted by the `PageAllocator`; the cache holds no reference of its own. A
page the cache knows and nobody references is *idle*: still reusable, and reclaimable. The
allocator reclaims idle pages (least recently used leaves first) only when its free list cannot
cover an allocation, so cached-but-idle pages count as free everywhere (`kv_pages_free`).

Invariant that makes the idle count exactly the reclaimable count: a request references either
the whole chain from the root to its deepest cached node or nothing of it (it reuses a chain
from the root, then extends the chain with its own pages; where someone else cached the same
page first, it swaps its copy for that one). So an idle node's descendants are idle, and
evicting leaves repeatedly reclaims every idle page.

Only full pages are cached, and a request always recomputes at least its last token (there must
be logits to sample). Models with slot states (DeepSeek-V4's sliding-window ring and compressor
stages, kept per request outside the pages) cannot resume from pages alone; the engine does not
build a cache for them (see docs/prefix-caching.md).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Optional

from dsv4_engine.kv_cache import PageAllocator
from dsv4_engine.sequence import Sequence


class _Node:
    __slots__ = ("tokens", "parent", "page", "children", "last_use")

    def __init__(self, tokens: tuple, parent: Optional["_Node"], page: int):
        self.tokens = tokens
        self.parent = parent
        self.page = page
        self.children: dict[tuple, _Node] = {}
        self.last_use = 0


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int):
        if allocator.cache is not None:
            raise ValueError("this allocator already has a prefix cache")
        self.allocator = allocator
        self.page_size = page_size
        self.root = _Node((), None, -1)
        self._by_page: dict[int, _Node] = {}
        self._idle: set[int] = set()
        self._heap: list[tuple[int, int, _Node]] = []  # (last_use, tie, node): idle leaves, lazily pruned
        self._clock = itertools.count(1)
        self._tie = itertools.count()
        self.query_tokens = 0  # tokens looked up at admission
        self.hit_tokens = 0  # of which found cached
        allocator.cache = self

    # ---- what the allocator asks (PageKeeper) ------------------------------------------------

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    @property
    def num_cached(self) -> int:
        """Pages the cache knows, referenced or idle."""
        return len(self._by_page)

    def holds(self, page: int) -> bool:
        return page in self._by_page

    def on_unreferenced(self, page: int) -> None:
        node = self._by_page[page]
        self._idle.add(page)
        node.last_use = next(self._clock)
        if not node.children:
            self._push(node)

    def on_referenced(self, page: int) -> None:
        self._idle.discard(page)

    def evict(self, n: int) -> list[int]:
        """Forget up to n idle pages, least recently used leaves first; their ids, now free."""
        out: list[int] = []
        while len(out) < n and self._heap:
            last_use, _, node = heapq.heappop(self._heap)
            if not self._evictable(node) or node.last_use != last_use:
                continue  # stale: referenced again, grew a child, or already gone
            parent = node.parent
            del parent.children[node.tokens]
            del self._by_page[node.page]
            self._idle.discard(node.page)
            out.append(node.page)
            if parent is not self.root and not parent.children and parent.page in self._idle:
                self._push(parent)
        return out

    def _evictable(self, node: _Node) -> bool:
        return (not node.children and self._by_page.get(node.page) is node and node.page in self._idle)

    def _push(self, node: _Node) -> None:
        if len(self._heap) > 2 * len(self._by_page) + 64:  # mostly stale entries: rebuild
            self._heap = [(n.last_use, next(self._tie), n) for n in self._by_page.values() if self._evictable(n)]
            heapq.heapify(self._heap)
        heapq.heappush(self._heap, (node.last_use, next(self._tie), node))

    # ---- what the scheduler asks -------------------------------------------------------------

    def _page_tokens(self, seq: Sequence, i: int) -> tuple:
        """The page's key under its parent: its token ids; the first page's key also holds the
        request's cache salt (a str, never equal to a token id), so each salt has its own tree
        below the root and no lookup crosses salts (vLLM mixes the salt into the first block's
        hash the same way)."""
        ps = self.page_size
        tokens = tuple(seq.token_at(j) for j in range(i * ps, (i + 1) * ps))
        salt = seq.params.cache_salt
        return (salt, *tokens) if i == 0 and salt else tokens

    def attach(self, seq: Sequence) -> int:
        """Give a request that holds nothing the pages of its longest cached prefix (full pages,
        never its last token), one reference each; returns the tokens it may skip."""
        assert not seq.pages and seq.num_computed == 0, "attach a request that holds no pages"
        usable = (seq.num_tokens - 1) // self.page_size
        node, chain = self.root, []
        for i in range(usable):
            child = node.children.get(self._page_tokens(seq, i))
            if child is None:
                break
            chain.append(child)
            node = child
        if chain:
            now = next(self._clock)
            for c in chain:
                c.last_use = now
            pages = [c.page for c in chain]
            self.allocator.share(pages)
            seq.pages = pages
        seq.cache_node = node if chain else None
        seq.num_cached_pages = len(chain)
        seq.num_computed = len(chain) * self.page_size
        return seq.num_computed

    def count(self, query: int, hit: int) -> None:
        """An admission looked up `query` tokens and reused `hit` of them."""
        self.query_tokens += query
        self.hit_tokens += hit

    def insert(self, seq: Sequence) -> None:
        """Cache the request's pages that became full (every token's KV computed) since last time."""
        full = min(seq.num_computed // self.page_size, len(seq.pages))
        while seq.num_cached_pages < full:
            i = seq.num_cached_pages
            parent = seq.cache_node or self.root
            tokens = self._page_tokens(seq, i)
            child = parent.children.get(tokens)
            if child is not None and child.page != seq.pages[i]:
                # Someone else cached this very page first (two requests computed the same prefix
                # at once, e.g. conversations over one system prompt admitted together): the same
                # tokens after the same prefix, so the same KV. Take theirs and give ours back, so
                # the request references the chain it extends (see the invariant above) and its
                # own later pages (its answer, which its next round re-sends) get cached too.
                own = seq.pages[i]
                self.allocator.share([child.page])
                seq.pages[i] = child.page
                self.allocator.free([own])
            elif child is None:
                child = _Node(tokens, parent, seq.pages[i])
                parent.children[tokens] = child
                self._by_page[child.page] = child
            seq.cache_node = child
            seq.num_cached_pages = i + 1

    @staticmethod
    def forget(seq: Sequence) -> None:
        """The request gave its pages back (finish, preemption, abort): no chain position left."""
        seq.cache_node = None
        seq.num_cached_pages = 0

    def stats(self) -> dict:
        return {"pages_cached": self.num_cached, "pages_idle": self.num_idle,
                "query_tokens": self.query_tokens, "hit_tokens": self.hit_tokens}

    def check(self) -> None:
        """Raise AssertionError when the tree and the allocator disagree (tests)."""
        seen = 0
        stack = [self.root]
        while stack:
            n = stack.pop()
            for c in n.children.values():
                assert c.parent is n and self._by_page.get(c.page) is c, f"page {c.page} not indexed"
                idle = c.page in self._idle
                assert idle == (self.allocator.refcount(c.page) == 0), f"page {c.page} idle flag disagrees"
                if idle:
                    assert all(g.page in self._idle for g in c.children.values()), f"idle page {c.page} has a held child"
                seen += 1
                stack.append(c)
        assert seen == len(self._by_page), "nodes outside the tree"
