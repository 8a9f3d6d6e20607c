"""The paged per-request state pool and the allocator that hands its pages out.

The model declares its states (`StateSpec`); the pool holds one page-major tensor per state,
[num_pages, num_layers, entries_per_page, *entry_shape], all indexed by the same page ids. A page
of one state is one contiguous byte range, so moving a request's state to another engine is one
descriptor per page per state. A layer's view states[name][:, layer] is what attention reads.
"""

from __future__ import annotations

import threading

import torch

from dsv4_engine.models.state import StateSpec


def page_nbytes(specs: list[StateSpec], page_size: int, dtype: torch.dtype) -> int:
    """Bytes one page costs across every state."""
    return sum(spec.page_nbytes(page_size, dtype) for spec in specs)


def pages_for_memory(specs: list[StateSpec], page_size: int, dtype: torch.dtype, memory_gb: float) -> int:
    return max(1, int(memory_gb * (1 << 30)) // page_nbytes(specs, page_size, dtype))


class KVPool:
    def __init__(self, specs: list[StateSpec], num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device):
        if not specs:
            raise ValueError("a model must declare at least one state")
        self.specs = {spec.name: spec for spec in specs}
        self.page_size = page_size
        self.num_pages = num_pages
        self.states: dict[str, torch.Tensor] = {
            spec.name: torch.zeros(num_pages, *spec.page_shape(page_size), dtype=dtype, device=device) for spec in specs
        }
        self.allocator = PageAllocator(num_pages)

    @property
    def tensor(self) -> torch.Tensor:
        """The first declared state (the only one for DeepSeek-V3)."""
        return next(iter(self.states.values()))

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page across every state."""
        return sum(t[0].numel() * t.element_size() for t in self.states.values())

    def bytes_per_token(self) -> dict[str, float]:
        """What each state costs per token of context (for /v1/loads and sizing)."""
        return {name: t[0].numel() * t.element_size() / self.page_size for name, t in self.states.items()}


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
