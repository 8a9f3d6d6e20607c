"""How many tokens of KV a GPU holds, and how many long-context agents a box keeps warm, from a
checkpoint's own state shapes (issue 46's capacity model).

Pure arithmetic over the model's declared states (`StateSpec`s, the same the pool allocates):
a page of every paged state per `page_size` tokens, plus a slot row per running request
(DeepSeek-V4's window ring and compressor staging). Two attention layouts:

- "tp" (tensor-parallel attention, what the engine runs today): every rank holds every
  request's KV (one KV head / one latent: nothing to split), so the box holds what one GPU's
  pool holds, however many GPUs.
- "dp" (data-parallel attention, SGLang's --enable-dp-attention): each rank attends over its
  own requests and holds only their KV, so the box holds N pools' worth.

Weights per GPU are the caller's (replicated bytes + bytes split over the GPUs): the same under
both layouts for V4, whose engine replicates attention and splits the routed experts.
`pool_tokens` is the engine's own arithmetic (kv_sizing.size_pool) so a running engine's
`/v1/loads` can be checked against it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from dsv4_engine.kv_cache import default_page_size, page_nbytes, slot_row_nbytes
from dsv4_engine.kv_quant import with_kv_cache_dtype

AGENT_CONTEXT = 32768  # tokens of context one agent keeps (a long tool-using conversation)
LAYOUTS = ("tp", "dp")


@dataclass(frozen=True)
class KVCost:
    """What the model's state costs in one pool: bytes per page (every paged state, every
    layer), tokens per page, bytes per running request (slot states)."""

    page_bytes: int
    page_size: int
    request_bytes: int

    @property
    def bytes_per_token(self) -> float:
        return self.page_bytes / self.page_size

    def agent_bytes(self, context: int) -> int:
        """One agent of `context` tokens: its whole pages and its slot row."""
        return math.ceil(context / self.page_size) * self.page_bytes + self.request_bytes


def kv_cost(specs: Iterable, dtype: torch.dtype, kv_cache_dtype: str, page_size: Optional[int] = None) -> KVCost:
    """The cost of the model's states (as `Model.state_specs(cfg)` declares them) in a pool of
    `dtype` with the attention KV stored as `kv_cache_dtype`; the engine's default page size."""
    specs = with_kv_cache_dtype(specs, kv_cache_dtype)
    size = page_size or default_page_size(specs)
    return KVCost(page_nbytes(specs, size, dtype), size, slot_row_nbytes(specs, dtype))


def pool_tokens(cost: KVCost, kv_bytes: int, max_num_seqs: int = 0, snapshots: int = 0) -> int:
    """Tokens of context a pool of `kv_bytes` holds once the slot rows of `max_num_seqs` requests
    and `snapshots` prefix-cache snapshots are set aside (what the engine's pool sizing does)."""
    left = kv_bytes - (max_num_seqs + snapshots) * cost.request_bytes
    return max(0, left // cost.page_bytes) * cost.page_size


@dataclass(frozen=True)
class Capacity:
    layout: str
    kv_cache_dtype: str
    weights_per_gpu: float  # bytes
    kv_bytes_per_gpu: float  # what is left for the pool after weights and the reserve
    kv_tokens_per_gpu: int  # tokens of context one GPU's pool holds (no request rows set aside)
    kv_tokens_box: int  # distinct tokens of context the whole box holds
    agents: int  # concurrent agents of `context` tokens the box holds (pages + slot rows)


def capacity(
    cost: KVCost,
    kv_cache_dtype: str,
    gpu_bytes: float,
    weights_replicated: float,
    weights_split: float,
    gpus: int,
    layout: str,
    reserve_bytes: float = 0.0,
    context: int = AGENT_CONTEXT,
) -> Capacity:
    """KV tokens per GPU and concurrent `context`-token agents on `gpus` GPUs of `gpu_bytes`
    each, for a layout of attention ("tp" or "dp")."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
    weights = weights_replicated + weights_split / gpus
    kv = max(0.0, gpu_bytes - weights - reserve_bytes)
    tokens = pool_tokens(cost, int(kv))
    per_gpu_agents = int(kv // cost.agent_bytes(context))
    copies = gpus if layout == "dp" else 1  # distinct pools on the box
    return Capacity(layout, kv_cache_dtype, weights, kv, tokens, tokens * copies, per_gpu_agents * copies)
