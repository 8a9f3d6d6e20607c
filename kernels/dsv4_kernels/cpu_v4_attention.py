"""DeepSeek-V4's decode attention on the CPU as one native call per layer (csrc/v4_attn_cpu.c):
window ring, this step's key and the visible compressed entries read in place, sink included,
instead of the torch form's gathers, concatenations, masks and ~25 ops. fp32 only; where native
code cannot run (dsv4_kernels.native) or DSV4_NO_NATIVE_V4_ATTN=1, `available()` is False and the
model keeps its torch form."""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from dsv4_kernels import native
from dsv4_kernels.native import F32, I64, P

_lib: Optional[ctypes.CDLL] = None


def available() -> bool:
    global _lib
    if _lib is None:
        _lib = native.load(
            "v4_attn_cpu",
            ["-march=native"],
            off_env="DSV4_NO_NATIVE_V4_ATTN",
            signatures={
                "v4_attn_decode": (
                    [P, P, P, I64, P, P, I64, P, I64, I64, P, I64, P, I64, I64, I64, P, F32, I64, I64, I64, P],
                    None,
                ),
                "v4_attn_extend": ([P, P, I64, P, P, P, I64, P, P, I64, I64, P, F32, I64, I64, I64, P], None),
                "v4_rms_rope": ([P, I64, I64, I64, I64, I64, I64, P, F32, P, I64, I64, P], None),
            },
        )
    return _lib is not None


def decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    ring: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    store: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    visible: Optional[torch.Tensor] = None,
    rate: int = 0,
    page_size: int = 0,
) -> torch.Tensor:
    """q [B, H, hd], kv [B, hd] fp32; ring [rows, W, hd] (a layer of the ring state: each row
    contiguous); slots, positions [B] int64; sink [H]. With compressed entries: store [pages, epp,
    hd] (a layer of the paged store), block_table [B, pages] int32, visible [B, C] bool. -> [B, H, hd]."""
    assert _lib is not None, "call available() first"
    B, H, hd = q.shape
    W = ring.shape[1]
    assert ring.dtype == q.dtype == kv.dtype == torch.float32 and ring.stride(1) == hd and ring.stride(2) == 1
    q, kv = q.contiguous(), kv.contiguous()
    slots, positions = slots.long().contiguous(), positions.long().contiguous()
    sink = sink.float().contiguous()
    out = torch.empty(B, H, hd, dtype=torch.float32)
    C = 0 if visible is None else visible.shape[1]
    if C:
        assert store.dtype == torch.float32 and store.stride(1) == hd and store.stride(2) == 1
        bt = block_table if block_table.dtype == torch.int32 else block_table.int()
        if bt.stride(1) != 1:
            bt = bt.contiguous()
        vis = visible.contiguous().view(torch.uint8)
        entry_args = (store.data_ptr(), store.stride(0), store.shape[1], bt.data_ptr(), bt.stride(0), vis.data_ptr())
    else:
        entry_args = (None, 0, 1, None, 0, None)
    _lib.v4_attn_decode(
        q.data_ptr(),
        kv.data_ptr(),
        ring.data_ptr(),
        ring.stride(0),
        slots.data_ptr(),
        positions.data_ptr(),
        W,
        *entry_args,
        C,
        rate,
        page_size or 1,
        sink.data_ptr(),
        scale,
        B,
        H,
        hd,
        out.data_ptr(),
    )
    return out


def extend(
    q: torch.Tensor,
    ext: torch.Tensor,
    row: torch.Tensor,
    n: torch.Tensor,
    start: torch.Tensor,
    W: int,
    sink: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    entries: Optional[torch.Tensor] = None,
    visible: Optional[torch.Tensor] = None,
) -> None:
    """A group of prefill chunks: request b's n[b] queries at rows row[b] .. of q [T, H, hd] over
    ext [B, W + Lmax, hd] (positions start[b] - W .. in order), each seeing its own last W
    positions, then entries [B, C, hd] where visible [B, Lmax, C]; written into out [>= T, H, hd]."""
    assert _lib is not None, "call available() first"
    B, ext_len, hd = ext.shape
    H = q.shape[1]
    assert q.dtype == ext.dtype == out.dtype == torch.float32 and q.is_contiguous() and out.is_contiguous()
    ext = ext.contiguous()
    row, n, start = row.long().contiguous(), n.long().contiguous(), start.long().contiguous()
    sink = sink.float().contiguous()
    C = 0 if visible is None else visible.shape[-1]
    if C:
        entries = entries.float().contiguous()
        vis = visible.contiguous().view(torch.uint8)
        Lmax = visible.shape[1]
    else:
        vis, Lmax = None, ext_len - W
    _lib.v4_attn_extend(
        q.data_ptr(),
        ext.data_ptr(),
        ext_len,
        row.data_ptr(),
        n.data_ptr(),
        start.data_ptr(),
        W,
        entries.data_ptr() if C else None,
        vis.data_ptr() if C else None,
        C,
        Lmax,
        sink.data_ptr(),
        scale,
        B,
        H,
        hd,
        out.data_ptr(),
    )


def rms_rope(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps: float,
    cis: Optional[torch.Tensor],
    norm: bool = True,
    conj: bool = False,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x [T, n, D] fp32 (channels contiguous) -> [T, n, D]: the rms norm (times weight when
    given; none when not `norm`), then the interleaved rope on the trailing channels with cis
    [T, D_rope / 2] complex64 (a `rope_table` half), by -angle when conj. out may be x itself."""
    assert _lib is not None, "call available() first"
    T, n, D = x.shape
    assert x.dtype == torch.float32 and x.stride(2) == 1
    y = torch.empty(T, n, D, dtype=torch.float32) if out is None else out
    assert y.is_contiguous()
    w = None if weight is None else weight.float().contiguous()
    c = None if cis is None else torch.view_as_real(cis).contiguous()
    _lib.v4_rms_rope(
        x.data_ptr(),
        T,
        n,
        D,
        x.stride(0),
        x.stride(1),
        int(norm),
        None if w is None else w.data_ptr(),
        eps,
        None if c is None else c.data_ptr(),
        0 if c is None else c.shape[1],
        int(conj),
        y.data_ptr(),
    )
    return y
