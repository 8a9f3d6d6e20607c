"""FP8 KV storage (`--kv-cache-dtype fp8_e4m3`): how an attention state's entries are quantized
when written and converted back when read.

Format, one per entry (one token's latent in one layer for DeepSeek-V3; one compressed entry,
indexer key or window slot for V4): the entry's D values as float8 e4m3 (1 byte each) followed
by one float32 scale (4 bytes), packed in a uint8 row of D + 4 bytes. The scale is the entry's
absolute maximum over 448 (e4m3's largest finite value), so every entry uses the whole FP8
range whatever its magnitude: the latent (RMS-normed) and the rope key (not normed) of a V3
entry share one scale, and e4m3's 3-bit mantissa bounds the relative error of each value at
2^-4 however small the entry. The scale travels inside the entry, so a page stays one
contiguous byte range (PD moves it as before) and every reader finds its scale beside it.
A per-token scale shared across layers would need a second tensor; a per-128-value tile (as
DeepSeek's own fp8_ds_mla cache) costs more bytes for little accuracy at these widths.

Bytes per entry: D + 4 against 2 D in bf16 (576 + 4 = 580 vs 1152 for V3's latent: 0.503x).

Models mark which states are attention KV (`StateSpec.quantizable`); `with_kv_cache_dtype`
turns those into packed states; the model's read and write sites call `store_`, `encode` and
`decode` (plain casts when the state is not packed), and whole-layer paged readers go through
`readable_pages` (the batch's pages decoded into a compact copy) unless the kernel reads FP8
itself (the Triton MLA decode). DeepSeek-V4's Triton kernels (attention over the ring and the
compressed entries, the indexer over its keys) always read the packed rows in place.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import torch

from dsv4_kernels.reference_quant import unpack_kv_rows

AUTO = "auto"
FP8_E4M3 = "fp8_e4m3"
# Accepted spellings (vLLM's `fp8` is e4m3); values are what the pool stores.
KV_CACHE_DTYPES = {AUTO: AUTO, FP8_E4M3: FP8_E4M3, "fp8": FP8_E4M3}
PACKED = torch.uint8  # the storage dtype of a packed state (nothing else in a pool is uint8)
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_BYTES = 4


def canonical(name: Optional[str]) -> str:
    """The pool's KV dtype for a flag value ("auto" when None); ValueError names the choices."""
    got = KV_CACHE_DTYPES.get(name or AUTO)
    if got is None:
        raise ValueError(f"--kv-cache-dtype {name!r} is not supported; choose one of {', '.join(KV_CACHE_DTYPES)}")
    return got


def with_kv_cache_dtype(specs: Iterable, kv_cache_dtype: Optional[str]) -> list:
    """The model's states with its attention KV stored as `kv_cache_dtype` (the others as they are)."""
    kind = canonical(kv_cache_dtype)
    out = []
    for spec in specs:
        if kind == FP8_E4M3 and spec.quantizable:
            width = spec.entry_shape[-1]
            if len(spec.entry_shape) != 1 or width % SCALE_BYTES:
                raise ValueError(
                    f"state {spec.name}: FP8 entries need a flat width that is a multiple of 4, not {spec.entry_shape}"
                )
            spec = dataclasses.replace(spec, kv_dtype=FP8_E4M3)
        out.append(spec)
    return out


def pool_kv_dtype(specs: Iterable) -> str:
    """What /v1/loads and the log call the pool's KV storage."""
    return FP8_E4M3 if any(getattr(s, "kv_dtype", AUTO) == FP8_E4M3 for s in specs) else AUTO


def is_packed(store: torch.Tensor) -> bool:
    return store.dtype == PACKED


def quantize(values: torch.Tensor) -> torch.Tensor:
    """[..., D] values -> [..., D + 4] packed uint8 (e4m3 values, then the entry's float32 scale)."""
    x = values.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return torch.cat([q.view(PACKED), scale.view(PACKED)], dim=-1)


def dequantize(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 4] packed -> [..., D] in `dtype` (the kernels' references read it the same way)."""
    return unpack_kv_rows(packed, dtype)


def encode(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`values` as `like` (a state tensor) stores them: packed FP8, or cast to its dtype."""
    return quantize(values) if is_packed(like) else values.to(like.dtype)


def decode(stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Entries read from a state, as `dtype` values (dequantized when packed)."""
    return dequantize(stored, dtype) if is_packed(stored) else stored.to(dtype)


def store_(store: torch.Tensor, index, values: torch.Tensor) -> None:
    """store[index] = values, quantized when the state is packed."""
    store[index] = encode(values, store)


def readable_pages(kv_layer: torch.Tensor, fb, dtype: torch.dtype, ops=None):
    """(layer, batch) a reader of whole paged layers can take: unchanged for a plain state, or
    for a decode step whose kernels read FP8 pages themselves (`ops.mla_decode_reads_fp8`: the
    Triton MLA decode loads e4m3 and multiplies by the scale in its tile loop); else, for a
    packed state, the batch's pages decoded into a compact [B * P, page, D] copy and the batch's
    block table renumbered onto it (P: pages of its longest request when the host knows the
    lengths, else the table's width). The copy is this step's working set, not the pool."""
    if not is_packed(kv_layer) or (fb.all_decode and getattr(ops, "mla_decode_reads_fp8", False)):
        return kv_layer, fb
    table = fb.block_table
    lens = getattr(fb, "seq_lens_host", None)
    if lens:
        table = table[:, : max(1, -(-max(lens) // kv_layer.shape[1]))]
    b, p = table.shape
    # slots past a request's last page may hold any id (never read): clamped into the pool
    dense = dequantize(kv_layer[table.reshape(-1).long().clamp_(0, kv_layer.shape[0] - 1)], dtype)
    renumbered = torch.arange(b * p, dtype=table.dtype, device=table.device).view(b, p)
    return dense, dataclasses.replace(fb, block_table=renumbered)
