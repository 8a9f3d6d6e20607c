"""What a model keeps per request, declared by the model and honoured by everything else.

A model class declares its per-request state as a list of `StateSpec`s. The pool allocates one
page-major tensor per paged state, memory sizing sums their bytes, the scheduler and preemption
hand out and take back pages for all of them together, and PD moves every region of a page.
DeepSeek-V3 declares one state (the MLA latent + rope key of each token in each layer); V4 adds
windowed and compressed states, which is why this is a list and not one shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateSpec:
    """One kind of per-request state.

    kind "paged": `entry_shape` per cached entry per layer, one entry per `tokens_per_entry`
    tokens (1 for a plain KV cache; a compressed state stores one entry per window), held in
    pages of `page_size` tokens. Every paged state shares the request's page ids.

    kind "slot": `slots` entries per layer per request whatever its length (a ring of the last
    tokens' sliding-window KV, a compressor's not-yet-closed window), held in one row per running
    request, [max_requests, num_layers, slots, *entry_shape], indexed by the request's slot id.
    """

    name: str
    num_layers: int
    entry_shape: tuple[int, ...]
    kind: str = "paged"
    tokens_per_entry: int = 1
    slots: int = 0  # kind "slot" only
    # Attention KV the model reads and writes through dsv4_engine.kv_quant: it may be stored in
    # FP8 (--kv-cache-dtype). `kv_dtype` "fp8_e4m3": each entry is D e4m3 bytes + a float32
    # scale, in a uint8 tensor (kv_quant's format); "auto": the model's dtype.
    quantizable: bool = False
    kv_dtype: str = "auto"

    @property
    def packed(self) -> bool:
        return self.kv_dtype != "auto"

    def storage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of this state's tensor in a pool whose model computes in `dtype`."""
        return torch.uint8 if self.packed else dtype

    def stored_entry_shape(self) -> tuple[int, ...]:
        """An entry's shape in storage: packed FP8 entries carry their 4-byte scale."""
        return (*self.entry_shape[:-1], self.entry_shape[-1] + 4) if self.packed else self.entry_shape

    @property
    def paged(self) -> bool:
        return self.kind == "paged"

    def slot_shape(self) -> tuple[int, ...]:
        """Shape of one request's row of a slot state: [num_layers, slots, *entry_shape]."""
        if self.kind != "slot":
            raise ValueError(f"state {self.name} is {self.kind}, not slot")
        return (self.num_layers, self.slots, *self.stored_entry_shape())

    def request_nbytes(self, dtype: torch.dtype) -> int:
        """Bytes a slot state costs per running request (0 for a paged state: that is per token)."""
        if self.kind != "slot":
            return 0
        n = 1
        for d in self.slot_shape():
            n *= d
        return n * torch.empty((), dtype=self.storage_dtype(dtype)).element_size()

    def entries_per_page(self, page_size: int) -> int:
        tpe = self.tokens_per_entry
        if tpe > page_size and tpe % page_size == 0:
            return 1  # a window spans several pages; its entry lives in the window's first page
        if page_size % tpe:
            raise ValueError(
                f"state {self.name}: page size {page_size} and {tpe} tokens per entry: one must divide the other"
            )
        return page_size // tpe

    def entry_location(self, entry, page_size: int):
        """(index into the request's pages, offset in that page) of entry number `entry`
        (an int or a tensor of them): the page holding the entry's first token."""
        return (entry * self.tokens_per_entry) // page_size, entry % self.entries_per_page(page_size)

    def page_shape(self, page_size: int) -> tuple[int, ...]:
        """Shape of one page of this state: [num_layers, entries, *entry_shape]."""
        return (self.num_layers, self.entries_per_page(page_size), *self.stored_entry_shape())

    def page_nbytes(self, page_size: int, dtype: torch.dtype) -> int:
        n = 1
        for d in self.page_shape(page_size):
            n *= d
        return n * torch.empty((), dtype=self.storage_dtype(dtype)).element_size()

    def bytes_per_token(self, dtype: torch.dtype) -> float:
        if self.kind == "slot":
            return 0.0  # fixed per request: see request_nbytes
        return self.page_nbytes(self.tokens_per_entry, dtype) / self.tokens_per_entry
