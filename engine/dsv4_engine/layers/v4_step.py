"""What DeepSeek-V4's layers share: the backend they run on (`V4Backend`), the per-request state
names, and what one forward step computes once for all of its layers (`V4Step`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dsv4_engine import kv_quant
from dsv4_engine.devices import upload
from dsv4_engine.quant import QuantWeight

# per-request state names (see models/deepseek_v4.py's table)
SWA_KV = "swa_kv"
CSA_KV = "csa_kv"
CSA_INDEX_K = "csa_index_k"
HCA_KV = "hca_kv"
CSA_STAGE = "csa_stage"
CSA_INDEX_STAGE = "csa_index_stage"
HCA_STAGE = "hca_stage"


@dataclass
class V4Backend:
    """The kernel backend as every V4 layer of one model sees it (one object, shared: switching
    the model's path switches its layers'). `kops`: the backend when it runs V4's kernel path
    (Triton), else None (the batched torch path); `one_call`: window attention as one backend
    call (the CPU's C kernel) on the torch path."""

    cfg: Any
    ops: Any
    dtype: torch.dtype = torch.float32  # the model's compute dtype
    kops: Any = None
    one_call: bool = False
    inv_freq: dict = field(default_factory=dict)  # rope tables' inverse frequencies, "main" / "compress"


class V4Step:
    """Index tensors and masks one step builds from host ints or from positions alone, made by the
    first layer that needs them and reused by the rest (`reuse`: off for bench/ab_v4_step.py's
    "before"). Uploading host ints does not wait for the device; learning the same indices from
    device values (nonzero, boolean masks, .max()) would, on a GPU."""

    def __init__(self, reuse: bool = True, take_rows: bool = True):
        self.reuse = reuse
        self.take_rows = take_rows
        self.cache: dict = {}

    def index(self, key: tuple, values, device: torch.device) -> torch.Tensor:
        """An index tensor built from host ints, uploaded once per step."""
        t = self.cache.get(key)
        if t is None:
            t = self.cache[key] = upload(values(), torch.long, device)
        return t

    def memo(self, key: tuple, make):
        """Anything computed from positions, slots and the block table alone (window masks, the
        entries' gather and window-closing indices): the same for every layer of a rate."""
        if not self.reuse:
            return make()
        got = self.cache.get(key)
        if got is None:
            got = self.cache[key] = make()
        return got

    def span_tensors(self, spans: list[tuple[int, int, int]], device: torch.device):
        """(first row, new tokens, first position) of each request as [B] tensors."""
        key = tuple(spans)
        return tuple(
            self.index((what, key), lambda c=c: [s[c] for s in spans], device)
            for c, what in enumerate(("row", "n", "start"))
        )

    def take(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x[idx] for an index tensor over x's first dim: by index_select, one copy per row,
        where advanced indexing walks every element (the same values, bit for bit)."""
        if not self.take_rows:
            return x[idx]
        return x.index_select(0, idx.reshape(-1)).view(*idx.shape, *x.shape[1:])


def locate(w: torch.Tensor, rate: int, page_size: int, epp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page column, offset) of compressed entries w, as StateSpec.entry_location: the page of
    the window's first token."""
    return (w * rate) // page_size, w % epp


def gather_entries(
    store: torch.Tensor, block_table: torch.Tensor, w: torch.Tensor, rate: int, page_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Entries w [C] of every request of block_table [B, pages] from a layer's paged store
    [num_pages, epp, dim]: [B, C, dim] as `dtype` (entries a request has not closed are masked by
    the caller)."""
    page, off = locate(w, rate, page_size, store.shape[1])
    got = store[block_table[:, page].long(), off[None].expand(block_table.shape[0], -1)]
    return kv_quant.decode(got, dtype)  # fp8kv: FP8 entries read as the model's dtype


def save_snapshots(
    fb, group: list[int], spans: list[tuple[int, int, int]], name: str, layer: int, ext: torch.Tensor
) -> None:
    """The prefix cache's snapshots inside this step's chunks (torch path): slot state `name`
    of request group[k] as it stands at a boundary b its chunk passes, taken from ext [B,
    S + Lmax, ...] (positions start - S ..: what the row held, then the chunk), into
    snapshot row sid at the ring offsets b - S .. b - 1 (mod S), as the row itself would
    hold them had the chunk ended at b. `fb.snapshots`: (request, b, sid) with start < b < end."""
    snaps = fb.snapshots
    if not snaps:
        return
    store = fb.snapshot_states[name]
    S = store.shape[2]
    keep = torch.arange(S, device=ext.device)
    for k, g in enumerate(group):
        for req, b, sid in snaps:
            if req == g:
                start = spans[k][2]
                store[sid, layer, (b - S + keep) % S] = kv_quant.encode(ext[k, b - start : b - start + S], store)


def held_tensors(obj: Any, depth: int = 0) -> list:
    """Every weight a layer (or a list of them) holds, for the resident-bytes log: its attributes,
    lists, tuples and dicts, not the shared backend."""
    if isinstance(obj, (torch.Tensor, QuantWeight)):
        return [obj]
    if depth > 6 or isinstance(obj, (V4Backend, str, int, float, type(None))):
        return []
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__"):
        items = [v for k, v in vars(obj).items() if k not in ("tp", "cfg")]
    else:
        return []
    return [t for v in items for t in held_tensors(v, depth + 1)]
