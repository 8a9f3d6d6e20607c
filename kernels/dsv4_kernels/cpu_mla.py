"""Absorbed-MLA decode attention on the CPU as one native call (csrc/mla_decode_cpu.c): every
request's latent rows read in place from the page pool through its page table, instead of the
torch form's page gather copy, two bmms and a softmax per tile (reference.mla_decode).

Same contract as reference.mla_decode for one query token per request. Built with the system C
compiler at first use (dsv4_kernels.native, -march=native: the build is keyed on the CPU's
flags); where no compiler works, or DSV4_NO_NATIVE_MLA=1 or DSV4_NO_NATIVE=1, `available()` is
False and the model keeps the torch form. `supports()` says which tensors it takes (CPU, an fp32
or bf16 pool whose pages are contiguous rows); anything else goes to the torch form too."""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from dsv4_kernels import native
from dsv4_kernels.native import F32, I32, I64, P

_lib: Optional[ctypes.CDLL] = None
_KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
FLAGS = ("-march=native",)  # besides native.BASE_FLAGS (bench/ab_attention.py --base builds with the same)


def available() -> bool:
    global _lib
    if _lib is None:
        _lib = native.load(
            "mla_decode_cpu",
            FLAGS,
            off_env="DSV4_NO_NATIVE_MLA",
            signatures={
                "mla_decode_paged": (
                    [P, P, I32, I64, I64, I64, P, I64, I64, P, I64, I64, I64, I64, F32, P],
                    ctypes.c_int,
                ),
            },
        )
    return _lib is not None


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether mla_decode takes these: CPU tensors, an fp32/bf16 query, an fp32/bf16 pool whose
    pages are runs of contiguous rows (any page stride: a layer's view of a page-major pool)."""
    return (
        q.device.type == "cpu"
        and kv_cache.device.type == "cpu"
        and q.dim() == 3
        and q.dtype in _KV_DTYPES
        and kv_cache.dtype in _KV_DTYPES
        and kv_cache.dim() == 3
        and kv_cache.stride(2) == 1
        and kv_cache.stride(1) == kv_cache.shape[2]
        and q.shape[2] == kv_cache.shape[2]
    )


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    v_dim: int,
) -> torch.Tensor:
    """q [B, H, D], kv_cache [num_pages, page_size, D], block_table [B, width], seq_lens [B] ->
    [B, H, v_dim] in q's dtype (see reference.mla_decode). Call `available()` and `supports()`
    first. A live token on a page id outside the pool, or past the table's width, raises IndexError."""
    assert _lib is not None, "call available() first"
    B, H, D = q.shape
    if not 0 < v_dim <= D:
        raise ValueError(f"v_dim {v_dim} outside (0, {D}]")
    qf = q.float().contiguous()
    table = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
    if table.stride(-1) != 1:
        table = table.contiguous()
    lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    lens = lens.contiguous()
    if table.shape[0] != B or lens.shape[0] != B:
        raise ValueError(f"block_table {tuple(table.shape)} / seq_lens {tuple(lens.shape)} do not match batch {B}")
    page_size = kv_cache.shape[1]
    out = torch.empty(B, H, v_dim, dtype=torch.float32)
    rc = _lib.mla_decode_paged(
        qf.data_ptr(),
        kv_cache.data_ptr(),
        _KV_DTYPES[kv_cache.dtype],
        kv_cache.shape[0],
        kv_cache.stride(0),
        page_size,
        table.data_ptr(),
        table.shape[1],
        table.stride(0),
        lens.data_ptr(),
        B,
        H,
        D,
        v_dim,
        sm_scale,
        out.data_ptr(),
    )
    if rc == -1:
        raise IndexError("mla_decode: a live token's page is outside the page pool or past the block table's width")
    if rc != 0:
        raise MemoryError("mla_decode: native scratch allocation failed")
    return out if q.dtype == torch.float32 else out.to(q.dtype)
