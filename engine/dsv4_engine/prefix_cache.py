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
be logits to sample).

Models with slot states (DeepSeek-V4's sliding-window ring and compressor stages, kept per
request outside the pages) cannot resume from pages alone. For them the cache keeps, beside the
pages, *snapshots* of a request's slot row (`SnapshotPool`) taken at *boundaries*: positions
that are a multiple of `boundary` tokens (a multiple of the page size and of every compression
window, so every compressed entry in the pages before it is final). Pages are cached only up to
the last boundary a request computed (a page past it may still receive the entry of a window
that closes later). A request resumes only at a boundary whose node holds a snapshot: it takes
the pages up to it and copies the snapshot into its own slot row. Which boundaries get one
(`snapshot_due`): the last boundary before a prompt's last token and the boundary where a prompt
branches off a cached one (the scheduler ends a chunk at each), any boundary a prefill chunk happens to end on, and during decoding the latest boundary
reached (the previous decode snapshot of the same request is dropped), so the next round of a
conversation resumes inside this round's answer. See docs/prefix-caching.md for what each costs.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Optional

from dsv4_engine.kv_cache import PageAllocator, SnapshotPool
from dsv4_engine.sequence import Sequence
from dsv4_wire.kv_events import chain_hash, root_hash


def page_hash(parent: Optional[bytes], key: tuple) -> bytes:
    """The contract's hash of a page from its parent's (None under the root) and its key, whose
    first element is the cache salt on a salted first page (see `_page_tokens`)."""
    if parent is None:
        salt = key[0] if key and isinstance(key[0], str) else None
        return chain_hash(root_hash(salt), key[1:] if salt else key)
    return chain_hash(parent, key)


# Conversations remembered ending at one page (PD decode): a shared prefix that many short
# requests end at keeps only the latest few.
TIPS_PER_PAGE = 4


class _Node:
    __slots__ = ("tokens", "parent", "page", "children", "last_use", "depth", "snapshot", "hash", "tips")

    def __init__(self, tokens: tuple, parent: Optional["_Node"], page: int):
        self.tokens = tokens
        self.parent = parent
        self.page = page
        self.children: dict[tuple, _Node] = {}
        self.last_use = 0
        self.depth = parent.depth + 1 if parent is not None else 0  # pages from the root, this one included
        self.snapshot: Optional[int] = None  # slot-row snapshot at this node's end (models with slot states)
        self.hash: Optional[bytes] = None  # the contract's page hash (dsv4_wire.kv_events), when published
        # PD decode: the tokens past this page of requests that ended with it as their deepest
        # cached page (rest of prompt + answer): a request starting with one continues that
        # conversation (pd.continuation); None until one ends here
        self.tips: Optional[list[tuple]] = None


class PrefixCache:
    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        snapshots: Optional[SnapshotPool] = None,
        boundary: Optional[int] = None,
        in_forward: bool = False,
        interval: int = 0,
    ):
        if allocator.cache is not None:
            raise ValueError("this allocator already has a prefix cache")
        self.allocator = allocator
        self.page_size = page_size
        # Models with slot states: resume only at multiples of `boundary` that hold a snapshot.
        self.snapshots = snapshots
        self.boundary = boundary or page_size
        if self.boundary % page_size:
            raise ValueError(f"prefix cache boundary {self.boundary} is not a multiple of the page size {page_size}")
        self._by_snapshot: dict[int, _Node] = {}
        # The model writes snapshots at boundaries inside a chunk (no chunk is cut short for
        # them); then also every `interval` tokens (a multiple of the boundary; 0: none).
        self.in_forward = in_forward
        self.interval = interval
        if interval % self.boundary:
            raise ValueError(f"snapshot interval {interval} is not a multiple of the boundary {self.boundary}")
        if snapshots is not None:
            snapshots.on_evict = self._snapshot_evicted
        self.root = _Node((), None, -1)
        self._by_page: dict[int, _Node] = {}
        self._idle: set[int] = set()
        self._heap: list[tuple[int, int, _Node]] = []  # (last_use, tie, node): idle leaves, lazily pruned
        self._clock = itertools.count(1)
        self._tie = itertools.count()
        self.query_tokens = 0  # tokens looked up at admission
        self.hit_tokens = 0  # of which found cached
        # Where the pages stored and evicted are told (/v1/kv_events; kv_journal.KVJournal), if anywhere.
        self.journal = None
        # Sessions' pinned chains (session_pins.SessionPins): evicted last; None: plain LRU.
        self.pins = None
        # The host tier below the device pool (host_tier.HostTier): evicted pages go there and
        # come back on a hit; None: evicted pages are lost.
        self.host = None
        self._host_hit = 0  # tokens the last attach took from the host tier
        # PD decode (--decode-local-prefill): remember where each request ended (_Node.tips)
        self.record_tips = False
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
        """Forget up to n idle pages, least recently used leaves first, pages pinned by a
        session (session_pins.py) only when no other is left; their ids, now free."""
        if self.pins is None:
            return self._evict(n, spare_pinned=False)
        self.pins.expire()
        out = self._evict(n, spare_pinned=True)
        if len(out) < n:  # running work never waits on a pin
            out += self._evict(n - len(out), spare_pinned=False)
        return out

    def _evict(self, n: int, spare_pinned: bool) -> list[int]:
        out: list[int] = []
        spared: list[tuple[int, int, _Node]] = []
        while len(out) < n and self._heap:
            entry = heapq.heappop(self._heap)
            last_use, _, node = entry
            if not self._evictable(node) or node.last_use != last_use:
                continue  # stale: referenced again, grew a child, or already gone
            if self.pins is not None and self.pins.holds(node.page):
                if spare_pinned:
                    spared.append(entry)
                    continue
                self.pins.dropped(node.page)
            parent = node.parent
            del parent.children[node.tokens]
            del self._by_page[node.page]
            if self.host is not None and node.hash is not None:  # down a tier, not lost
                if self.host.put(node.hash, node.tokens, node.page) and self.journal is not None:
                    self.journal.stored("host", node.hash)
                if node.snapshot is not None:
                    self.host.put_snapshot(node.hash, node.snapshot)
            if node.snapshot is not None:
                self._drop_snapshot(node)
            self._idle.discard(node.page)
            if self.journal is not None and node.hash is not None:
                self.journal.evicted("device", node.hash)
            out.append(node.page)
            if parent is not self.root and not parent.children and parent.page in self._idle:
                self._push(parent)
        for entry in spared:
            heapq.heappush(self._heap, entry)
        return out

    def _evictable(self, node: _Node) -> bool:
        return not node.children and self._by_page.get(node.page) is node and node.page in self._idle

    def _push(self, node: _Node) -> None:
        if len(self._heap) > 2 * len(self._by_page) + 64:  # mostly stale entries: rebuild
            self._heap = [(n.last_use, next(self._tie), n) for n in self._by_page.values() if self._evictable(n)]
            heapq.heapify(self._heap)
        heapq.heappush(self._heap, (node.last_use, next(self._tie), node))

    # ---- what the scheduler asks -------------------------------------------------------------

    def _page_tokens(self, seq: Sequence, i: int) -> tuple:
        """The key of a request's page i under its parent (the one place that spells keys): its
        tokens, and with boundaries longer than a page, every later token up to the boundary. A
        page's state can depend on them: a compressed entry lives in its window's first page, so
        with pages shorter than the window, page 2w of HCA-every-8 in pages of 4 holds an entry
        pooled from page 2w+1's tokens too. The first page's key also holds the request's cache
        salt (a str, never equal to a token id), so each salt has its own tree below the root and
        no lookup crosses salts (vLLM mixes the salt into the first block's hash the same way)."""
        ps = self.page_size
        end = (i * ps // self.boundary + 1) * self.boundary
        tokens = tuple(seq.token_at(j) for j in range(i * ps, end))
        salt = seq.params.cache_salt
        return (salt, *tokens) if i == 0 and salt else tokens

    # ---- snapshots (models with slot states) ---------------------------------------------------

    def _snapshot_evicted(self, snap: int) -> None:
        """The snapshot pool took this snapshot back for room: its node keeps its pages."""
        node = self._by_snapshot.pop(snap)
        node.snapshot = None
        if self.host is not None and node.hash is not None:  # the row is still intact here
            self.host.put_snapshot(node.hash, snap)

    def _drop_snapshot(self, node: _Node) -> None:
        snap, node.snapshot = node.snapshot, None
        del self._by_snapshot[snap]
        self.snapshots.drop(snap)

    def _resumable(self, node: _Node) -> bool:
        """Whether a request can resume right after this node (the root: from nothing)."""
        if node is self.root:
            return True
        if self.snapshots is None:
            return True
        return node.snapshot is not None

    def snapshot_stop(self, seq: Sequence) -> Optional[int]:
        """Where a prefill chunk of this request should end so that a snapshot can be taken there,
        the first still ahead of: the deepest boundary its prompt shares with cached pages that
        hold no snapshot there (where it branches off another prompt: a shared system prompt
        gets a snapshot at its end), and the last boundary before its last token. None for a
        model without slot states, or nothing ahead."""
        if self.snapshots is None or self.in_forward:
            return None
        last = (seq.num_tokens - 1) // self.boundary * self.boundary
        for stop in (seq.cache_branch, last):
            if stop > seq.num_computed:
                return stop
        return None

    def snapshot_points(self, seq: Sequence, n: int) -> list[int]:
        """Boundaries strictly inside the next n tokens of this request where the model should
        write a snapshot (in_forward only): where its prompt branches off the cached path, its
        prompt's last boundary, and every `interval` tokens. (A chunk ending on a boundary is
        snapshotted from the row afterwards: `snapshot_due`.)"""
        if self.snapshots is None or not self.in_forward or n <= 1:
            return []
        start, end = seq.num_computed, seq.num_computed + n
        last = (seq.num_tokens - 1) // self.boundary * self.boundary
        points = {p for p in (seq.cache_branch, last) if start < p < end and p % self.boundary == 0}
        if self.interval:
            points.update(range((start // self.interval + 1) * self.interval, end, self.interval))
        return sorted(points)

    def link_snapshots(self, seq: Sequence, taken: list[tuple[int, int]]) -> None:
        """After a step whose forward wrote snapshots (position, reserved row) for this request
        (and `insert`): each becomes its boundary's, or goes back when the boundary has one or
        its page is not the request's cached chain."""
        node, depth = seq.cache_node, seq.num_cached_pages
        last = (seq.num_tokens - 1) // self.boundary * self.boundary
        for pos, snap in sorted(taken, reverse=True):
            want = pos // self.page_size
            while node is not None and depth > want:
                node, depth = node.parent, depth - 1
            if node is None or node is self.root or depth != want or node.snapshot is not None:
                self.snapshots.release(snap)
                continue
            # the interval's snapshots are a guess at where an unseen prompt will branch: they
            # go first when the pool is full, until one is used
            keep = pos in (seq.cache_branch, last)
            self.snapshots.commit(snap, recent=keep)
            node.snapshot = snap
            self._by_snapshot[snap] = node
            if keep and (seq.snapshot_node is None or seq.snapshot_node.depth < node.depth):
                self._supersede(seq, node, pos)
                seq.snapshot_node, seq.snapshot_id = node, snap

    def snapshot_due(self, seq: Sequence) -> None:
        """After a step: when the request stands exactly on a cached boundary that holds no
        snapshot, keep a copy of its slot row there."""
        pos = seq.num_computed
        if (
            self.snapshots is None
            or seq.slot is None
            or pos == 0
            or pos % self.boundary
            or seq.num_cached_pages * self.page_size != pos
            or seq.cache_node is None
            or seq.cache_node.snapshot is not None
        ):
            return
        node = seq.cache_node
        self._supersede(seq, node, pos)
        node.snapshot = self.snapshots.save(seq.slot)
        self._by_snapshot[node.snapshot] = node
        seq.snapshot_node, seq.snapshot_id = node, node.snapshot

    def _supersede(self, seq: Sequence, node: _Node, pos: int) -> None:
        """A request about to keep a snapshot deeper on its own path: the one it kept before is
        worth less now (its next round resumes at the deeper one). An earlier decode snapshot
        is dropped (one per answer, not one per boundary of a long answer); a prompt's goes to
        the front of the pool's LRU, so that many conversations at once keep each one's latest."""
        prev = seq.snapshot_node
        if prev is None or prev is node or prev.snapshot is None or prev.snapshot != seq.snapshot_id:
            return
        if pos > len(seq.prompt_ids) and prev.depth * self.page_size > len(seq.prompt_ids):
            self._drop_snapshot(prev)
        else:
            self.snapshots.demote(prev.snapshot)

    def _walk(self, seq: Sequence) -> tuple[list["_Node"], int]:
        """The cached chain of the request's prefix (whole boundaries, never its last token), and
        how many pages it could use at most."""
        usable = (seq.num_tokens - 1) // self.boundary * self.boundary // self.page_size
        node, chain = self.root, []
        for i in range(usable):
            child = node.children.get(self._page_tokens(seq, i))
            if child is None:
                break
            chain.append(child)
            node = child
        return chain, usable

    def match(self, seq: Sequence) -> int:
        """Pages of its prefix `attach` would give the request now (a look, nothing taken; no host tier)."""
        chain, _ = self._walk(seq)
        while chain and not self._resumable(chain[-1]):
            chain.pop()
        return len(chain)

    def attach(self, seq: Sequence) -> int:
        """Give a request that holds nothing the pages of its longest cached prefix (full pages,
        never its last token), one reference each; returns the tokens it may skip."""
        assert not seq.pages and seq.num_computed == 0, "attach a request that holds no pages"
        chain, usable = self._walk(seq)
        seq.cache_branch = len(chain) * self.page_size // self.boundary * self.boundary
        walked = len(chain)
        while chain and not self._resumable(chain[-1]):
            chain.pop()  # slot states: back to the deepest boundary that holds a snapshot
        if chain and self.snapshots is not None:
            assert seq.slot is not None, "a model with slot states attaches a request that holds its row"
            self.snapshots.restore(chain[-1].snapshot, seq.slot)
        if chain:
            now = next(self._clock)
            for c in chain:
                c.last_use = now
            pages = [c.page for c in chain]
            self.allocator.share(pages)
            seq.pages = pages
        seq.cache_node = chain[-1] if chain else None
        seq.num_cached_pages = len(chain)
        seq.num_computed = len(chain) * self.page_size
        self._host_hit = 0
        if self.host is not None and len(chain) == walked:  # (past an unresumable device page: no)
            self._from_host(seq, usable)
        return seq.num_computed

    def _from_host(self, seq: Sequence, usable: int) -> None:
        """Continue a request's cached chain with the pages the host tier holds past it, up to
        the deepest point it can resume at (any page; with slot states, a boundary whose snapshot
        the host holds too): each page is copied into a new device page and becomes a device
        node again, and the snapshot into the request's slot row (and a device snapshot)."""
        parent = seq.cache_node or self.root
        start = seq.num_cached_pages
        if parent is not self.root and parent.hash is None:
            return
        # look ahead first: how far the host holds this prompt, and where it can resume
        found, h, resume = [], parent.hash, start
        for i in range(start, usable):
            key = self._page_tokens(seq, i)
            node_h = page_hash(h, key)
            if (h is parent.hash and key in parent.children) or not self.host.holds(node_h):
                break
            found.append((key, node_h))
            h = node_h
            if self.snapshots is None or (
                (i + 1) * self.page_size % self.boundary == 0 and self.host.holds_snapshot(h)
            ):
                resume = i + 1
        got = 0
        for key, h in found[: resume - start]:
            page = self.allocator.allocate(1)  # may push other idle pages down (never this chain)
            if page is None:
                break
            if not self.host.take(h, key, page[0]):  # the allocation pushed it out of the host tier
                self.allocator.free(page)
                break
            node = _Node(key, parent, page[0])
            node.hash, node.last_use = h, next(self._clock)
            parent.children[key] = node
            self._by_page[node.page] = node
            if self.journal is not None:
                self.journal.stored("device", h)
            seq.pages.append(node.page)
            seq.cache_node, parent = node, node
            seq.num_cached_pages += 1
            got += 1
        if self.snapshots is not None and got:
            depth = seq.num_cached_pages
            # back to the deepest boundary whose snapshot can be restored (all of them, unless an
            # allocation above cut the walk short or pushed a snapshot out)
            while depth > start and not (
                depth * self.page_size % self.boundary == 0 and self.host.holds_snapshot(seq.cache_node.hash)
            ):
                depth -= 1
                seq.cache_node = seq.cache_node.parent
            if depth == start:  # nothing to resume at: keep the promoted pages cached, use none
                self._give_back(seq, start)
                return
            self._give_back(seq, depth)
            self.host.take_snapshot(seq.cache_node.hash, self.snapshots.slot_states, seq.slot)
            if self.snapshots.mirror is not None:
                raise RuntimeError("the host tier does not run at --tp-size > 1")
            node = seq.cache_node
            node.snapshot = self.snapshots.save(seq.slot)
            self._by_snapshot[node.snapshot] = node
            seq.cache_branch = max(seq.cache_branch, depth * self.page_size)
            got = depth - start
        seq.num_computed = seq.num_cached_pages * self.page_size
        self._host_hit = got * self.page_size  # counted when the request is admitted (`count`)

    def _give_back(self, seq: Sequence, depth: int) -> None:
        """Keep only the first `depth` pages of the request's chain (the rest stay cached, idle)."""
        extra = seq.pages[depth:]
        if extra:
            del seq.pages[depth:]
            self.allocator.free(extra)
        node = seq.cache_node
        while node is not self.root and node is not None and node.depth > depth:
            node = node.parent
        seq.cache_node = node if node is not self.root else None
        seq.num_cached_pages = depth

    def count(self, query: int, hit: int) -> None:
        """An admission looked up `query` tokens and reused `hit` of them."""
        self.query_tokens += query
        self.hit_tokens += hit
        if self.host is not None:  # of the hit, what the last attach took from the host tier
            self.host.hit_tokens += min(self._host_hit, hit)
            self._host_hit = 0

    def insert(self, seq: Sequence) -> None:
        """Cache the request's pages that became full (every token's KV computed) since last
        time; with slot states, only those before the last boundary it computed (final)."""
        done = seq.num_computed // self.boundary * self.boundary if self.snapshots is not None else seq.num_computed
        full = min(done // self.page_size, len(seq.pages))
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
                if parent is self.root or parent.hash is not None:
                    child.hash = page_hash(parent.hash, tokens)
                    if self.journal is not None:
                        self.journal.stored("device", child.hash)
            seq.cache_node = child
            seq.num_cached_pages = i + 1

    def forget(self, seq: Sequence) -> None:
        """The request gave its pages back (finish, preemption, abort): no chain position left.
        A named session's chain stays pinned for its TTL (session_pins.py)."""
        if self.pins is not None and seq.params.session and seq.cache_node is not None:
            self._pin(seq)
        if self.record_tips and seq.cache_node is not None:
            node = seq.cache_node
            tip = tuple(seq.token_at(j) for j in range(node.depth * self.page_size, seq.num_tokens))
            node.tips = [t for t in (node.tips or []) if t != tip][-(TIPS_PER_PAGE - 1) :] + [tip]
        seq.cache_node = None
        seq.num_cached_pages = 0
        seq.snapshot_node = None
        seq.snapshot_id = None

    def _pin(self, seq: Sequence) -> None:
        pages, node = [], seq.cache_node
        while node is not None and node is not self.root:
            pages.append(node.page)
            node = node.parent
        key = (seq.params.cache_salt or "", seq.params.session)
        self.pins.pin(key, pages, seq.params.session_ttl)

    def stats(self) -> dict:
        out = {
            "pages_cached": self.num_cached,
            "pages_idle": self.num_idle,
            "query_tokens": self.query_tokens,
            "hit_tokens": self.hit_tokens,
        }
        if self.snapshots is not None:
            sp = self.snapshots
            out.update(
                boundary_tokens=self.boundary,
                snapshot_interval_tokens=self.interval,
                snapshots_in_forward=self.in_forward,
                snapshots_cached=sp.num_used,
                snapshots_total=sp.total,
                snapshots_saved=sp.saved,
                snapshots_restored=sp.restored,
                snapshots_evicted=sp.evicted,
            )
        return out

    def bytes_by_state(self, page_bytes: dict[str, int]) -> dict[str, int]:
        """What the cache holds now per state kind: cached pages of each paged state (bytes of one
        page given), snapshots of each slot state."""
        out = {name: n * self.num_cached for name, n in page_bytes.items()}
        if self.snapshots is not None:
            for name, n in self.snapshots.bytes_per_snapshot().items():
                out[name] = n * self.snapshots.num_used
        return out

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
                    assert all(g.page in self._idle for g in c.children.values()), (
                        f"idle page {c.page} has a held child"
                    )
                seen += 1
                stack.append(c)
        assert seen == len(self._by_page), "nodes outside the tree"
        if self.snapshots is not None:
            for snap, node in self._by_snapshot.items():
                assert node.snapshot == snap and self._by_page.get(node.page) is node, f"snapshot {snap} of a gone node"
                assert node.depth * self.page_size % self.boundary == 0, f"snapshot {snap} off a boundary"
                assert self.snapshots.holds(snap), f"snapshot {snap} not held by the pool"
            assert len(self._by_snapshot) == self.snapshots.num_used, "snapshots held outside the tree"
            assert self.snapshots.num_reserved == 0, "snapshots reserved by no step"
