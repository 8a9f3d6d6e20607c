"""PD decode serving the next round of a conversation itself (`--decode-local-prefill N`).

Round N+1 of a conversation re-sends round N's prompt and answer plus a new turn. The engine that
holds all of that is decode: it received round N's prompt state from prefill and computed the
answer. With a prefix cache of its own (pages of prompt + answer, and for DeepSeek-V4 the slot-row
snapshot at the answer's last boundary), decode resumes the conversation where it stands and
prefills only the new turn, as a monolithic engine would; prefill is told (a registration marked
`local`) to drop the room without computing or sending anything. A request whose uncached tail is
longer than N tokens (a new conversation, a long tool result) goes the usual way: prefill computes
it and ships every page.

Why there and not elsewhere (docs/prefix-caching.md, "PD"): prefill never saw the answer, so a
delta computed on prefill needs the answer's KV written back from decode first (a second transfer
per round, the other way) and still ships the whole conversation or needs decode-side matching on
top; computing the short tail where the KV already is moves nothing at all.
"""

from __future__ import annotations

from typing import Any

PrefixCache = Sequence = Any  # dsv4_engine.prefix_cache.PrefixCache, dsv4_engine.sequence.Sequence


def cached_prefix_tokens(cache: PrefixCache, seq: Sequence) -> tuple[int, bool]:
    """Tokens of `seq` the cache would let it skip now (what `PrefixCache.attach` would give),
    without taking anything: whole boundaries, never the last token, and for a model with slot
    states only up to the deepest node holding a snapshot; and whether `seq` continues a request
    this engine served (starts with all of that request's tokens, its answer included)."""
    usable = (seq.num_tokens - 1) // cache.boundary * cache.boundary // cache.page_size
    node, best, continues = cache.root, 0, False
    for i in range(usable):
        node = node.children.get(cache._page_tokens(seq, i))
        if node is None:
            break
        if (i + 1) * cache.page_size % cache.boundary == 0 and cache._resumable(node):
            best = i + 1
        continues = continues or _continues_a_tip(node, seq, (i + 1) * cache.page_size)
    return best * cache.page_size, continues


def _continues_a_tip(node, seq: Sequence, start: int) -> bool:
    for tip in node.tips or ():
        end = start + len(tip)
        if end < seq.num_tokens and all(seq.token_at(start + j) == t for j, t in enumerate(tip)):
            return True
    return False


def serve_locally(num_tokens: int, cached: int, limit: int, continues: bool = True) -> bool:
    """Whether decode computes this request itself: it continues a conversation decode served
    (not merely a prompt sharing a prefix with one: a new conversation over a cached system
    prompt, a repeated prompt, belong to prefill), decode holds some of it, and at most `limit`
    tokens are left to compute (the last one always is)."""
    return limit > 0 and continues and cached > 0 and num_tokens - cached <= limit
