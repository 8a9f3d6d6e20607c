"""The paged latent KV cache: one page-major pool and the allocator that hands its pages out.

Pool layout [num_pages, num_layers, page_size, kv_dim]: a page holds its tokens for every layer
in one contiguous byte range, so moving a request's KV to another engine is one descriptor per
page. A layer's view pool[:, layer] is what attention reads.
"""

from __future__ import annotations

import threading

import torch

from dsv4_engine.config import ModelConfig


def pages_for_memory(cfg: ModelConfig, page_size: int, dtype: torch.dtype, memory_gb: float) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    page_bytes = cfg.num_hidden_layers * page_size * cfg.kv_cache_dim * elem
    return max(1, int(memory_gb * (1 << 30)) // page_bytes)


class KVPool:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device):
        self.page_size = page_size
        self.num_pages = num_pages
        self.tensor = torch.zeros(num_pages, cfg.num_hidden_layers, page_size, cfg.kv_cache_dim, dtype=dtype, device=device)
        self.allocator = PageAllocator(num_pages)

    @property
    def page_nbytes(self) -> int:
        return self.tensor[0].numel() * self.tensor.element_size()


class PageAllocator:
    """A free list of page ids. Every page handed out must come back exactly once; a double free
    is a bug we want loudly, since a page leak is how a PD engine slowly wedges."""

    def __init__(self, num_pages: int):
        self.total = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._used: set[int] = set()
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n pages, or None (and nothing taken) when fewer are free."""
        with self._lock:
            if n > len(self._free):
                return None
            pages = [self._free.pop() for _ in range(n)]
            self._used.update(pages)
            return pages

    def free(self, pages: list[int]) -> None:
        with self._lock:
            for p in pages:
                if p not in self._used:
                    raise RuntimeError(f"page {p} freed twice or never allocated")
                self._used.remove(p)
                self._free.append(p)
