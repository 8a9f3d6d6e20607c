"""The page books of a data-parallel-attention engine (`--dp-size N`): one page pool per rank.

Rank r's KV tensors hold only the pages of the requests it serves, so each rank's pool is a
whole pool (not a mirror of rank 0's). Rank 0 keeps every rank's books in one id space: global
page id g lives on rank g // pages_per_rank as local page g % pages_per_rank. A request's pages
all come from one rank's pool, chosen when it takes its first page (the rank with the most free
pages: load by KV, then the lower rank; with the prefix cache, `choose_rank` from its cached
prefix on each rank too), so the rank of a request is the rank of its pages and the step's
batch splits by them (`dp_batch`).

A model with slot rows (DeepSeek-V4's window ring and compressor stages, a fixed cost per
request) has them per rank too: each rank's pool holds `slot_rows_per_rank` rows, and rank 0's
`DPSlotAllocator` numbers them as pages are numbered (global row g: rank g // per_rank, local row
g % per_rank). A request takes its row on the rank of its pages, so placement skips a rank whose
rows are all held.
"""

from __future__ import annotations

from dsv4_engine.kv_cache import PageAllocator, SlotAllocator


# How many more running requests than the least busy rank a rank holding a request's prefix may
# have and still get it, as a share of the mean running requests per rank (at least 1): within it,
# reusing the prefix (its prefill and its pages) is worth more than evening out the step's work;
# past it, load decides.
BALANCE_SLACK = 0.25


def slot_rows_per_rank(max_num_seqs: int, dp_size: int) -> int:
    """Slot rows each rank's pool holds: an even share of --max-num-seqs, rounded up (the ranks
    together run at most max_num_seqs requests; a rank whose rows are all held takes no more)."""
    return -(-max_num_seqs // dp_size)


def choose_rank(
    matched: list[int],
    free: list[int],
    need: int = 0,
    running: list[int] | None = None,
    rows: list[int] | None = None,
) -> int:
    """The rank a request runs on. `matched[r]`: pages of its prefix rank r's cache holds;
    `free[r]`: pages rank r can hand out (idle cached ones included); `need`: pages the whole
    request takes; `running[r]`: requests running on rank r; `rows[r]`: free slot rows of rank r
    (a model with slot rows). Among the ranks that can hold what the request still needs (all of
    them when none can; a rank with no free slot row never): the longest match on a rank within the
    slack of the least busy (then fewer running requests, more free pages, the lower rank); with
    none, the most free pages (load by KV), then the lower rank."""
    ranks = range(len(free))
    running = running or [0] * len(free)
    open_ = [r for r in ranks if rows is None or rows[r] > 0] or list(ranks)
    fits = [r for r in open_ if free[r] >= need - matched[r]] or open_
    least = min(running[r] for r in fits)
    slack = max(1, int(BALANCE_SLACK * sum(running) / len(running)))
    near = [r for r in fits if matched[r] and running[r] - least <= slack]
    if near:
        return max(near, key=lambda r: (matched[r], -running[r], free[r], -r))
    return max(fits, key=lambda r: (free[r], -r))


class DPPageAllocator:
    """N PageAllocators behind the one interface the scheduler uses (allocate, share, free, the
    counts). With the prefix cache each rank's allocator has a cache of its own
    (`dp_cache.DPPrefixCache` sets them); `cache` here stays None."""

    def __init__(self, dp_size: int, pages_per_rank: int):
        self.dp_size = dp_size
        self.pages_per_rank = pages_per_rank
        self.total = dp_size * pages_per_rank
        self.ranks = [PageAllocator(pages_per_rank) for _ in range(dp_size)]
        self.cache = None
        self.slots: DPSlotAllocator | None = None  # a model with slot rows (the engine sets it)

    def rank_of(self, page: int) -> int:
        return page // self.pages_per_rank

    @property
    def num_free(self) -> int:
        return sum(a.num_free for a in self.ranks)

    @property
    def num_unused(self) -> int:
        return sum(a.num_unused for a in self.ranks)

    def refcount(self, page: int) -> int:
        r, local = divmod(page, self.pages_per_rank)
        return self.ranks[r].refcount(local)

    def least_loaded(self) -> int:
        """The rank a new request goes to: the most free pages, then the lower rank."""
        return choose_rank([0] * self.dp_size, [a.num_free for a in self.ranks], rows=self.rows_free())

    def rows_free(self) -> list[int] | None:
        """Free slot rows of each rank (None: the model has none)."""
        return None if self.slots is None else self.slots.free_per_rank()

    def allocate(self, n: int, rank: int = 0) -> list[int] | None:
        got = self.ranks[rank].allocate(n)
        return None if got is None else [rank * self.pages_per_rank + p for p in got]

    def allocate_beside(self, held: list[int], n: int) -> list[int] | None:
        """n more pages for a request that holds `held`: on its rank, or (none held yet) on the
        least loaded one."""
        return self.allocate(n, self.rank_of(held[0]) if held else self.least_loaded())

    def allocate_to_receive(self, n: int) -> list[int] | None:
        """PD decode: n pages for a request whose KV a prefill will write, all on the rank chosen
        by load now, before it registers (the registration names that rank's pool alone)."""
        return self.allocate_beside([], n)

    def same_pool(self, a: list[int], b: list[int]) -> bool:
        """Whether freeing pages `a` makes room for a request holding `b` (preemption's victim)."""
        return not a or not b or self.rank_of(a[0]) == self.rank_of(b[0])

    def _by_rank(self, pages: list[int]) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for p in pages:
            r, local = divmod(p, self.pages_per_rank)
            out.setdefault(r, []).append(local)
        return out

    def share(self, pages: list[int]) -> None:
        for r, local in self._by_rank(pages).items():
            self.ranks[r].share(local)

    def free(self, pages: list[int]) -> None:
        for r, local in self._by_rank(pages).items():
            self.ranks[r].free(local)

    def held_per_rank(self) -> list[int]:
        """Pages each rank's requests or cache hold now."""
        return [self.pages_per_rank - a.num_unused for a in self.ranks]

    def running_per_rank(self, running: list) -> list[int]:
        """Requests of `running` (the scheduler's) on each rank (a request holding no page: none)."""
        out = [0] * self.dp_size
        for seq in running:
            if seq.pages:
                out[self.rank_of(seq.pages[0])] += 1
        return out

    def free_per_rank(self) -> list[int]:
        """Pages each rank can hand out now (idle cached ones included)."""
        return [a.num_free for a in self.ranks]


class DPSlotAllocator:
    """N SlotAllocators, one per rank's pool, in one id space (global row g: rank g // per_rank).
    The scheduler takes a request's row once its pages placed it (`allocate_beside`)."""

    follows_pages = True  # the scheduler allocates the row after the pages, on their rank

    def __init__(self, dp_size: int, per_rank: int, pages_per_rank: int):
        self.per_rank = per_rank
        self.pages_per_rank = pages_per_rank
        self.total = dp_size * per_rank
        self.ranks = [SlotAllocator(per_rank) for _ in range(dp_size)]

    @property
    def num_free(self) -> int:
        return sum(a.num_free for a in self.ranks)

    def free_per_rank(self) -> list[int]:
        return [a.num_free for a in self.ranks]

    def rank_of(self, slot: int) -> int:
        return slot // self.per_rank

    def allocate_on(self, rank: int) -> int | None:
        got = self.ranks[rank].allocate()
        return None if got is None else rank * self.per_rank + got

    def allocate_beside(self, pages: list[int]) -> int | None:
        """A row on the rank of `pages` (a request's, at least one)."""
        return self.allocate_on(pages[0] // self.pages_per_rank)

    def free(self, slot: int) -> None:
        r, local = divmod(slot, self.per_rank)
        self.ranks[r].free(local)
