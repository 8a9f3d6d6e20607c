"""Back long-lived CPU tensors (the weights) with 2 MB pages.

A CPU decode step streams every weight from memory. With 4 KB pages the hardware prefetcher
stops at each page boundary and every page costs a TLB entry; Linux
hands out 2 MB pages to anonymous memory only where asked (transparent huge pages in `madvise`
mode, the default of most distributions). `advise` marks a storage's 2 MB-aligned part
MADV_HUGEPAGE and collapses what is already there (MADV_COLLAPSE, Linux 6.1+; on older kernels
khugepaged collapses it later): the weights, once at load, ~0.1-1.5 ms a MB (the first 2 MB pages
a VM hands out cost the most). The KV pool keeps 4 KB pages: a 1 GiB pool on 2 MB pages took ~1.4
s more to start on this project's VMs for no gain measured at 32 streams. The same bytes, no
copy; where it cannot (another OS, THP off, no free 2 MB pages) nothing changes.
DSV4_NO_HUGE_PAGES=1 turns it off. Measured: bench/results/decode_breakdown/README.md, section 9.
"""

from __future__ import annotations

from dsv4_wire import switches

import ctypes
import sys
from typing import Iterable, Optional

import torch

_HUGE = 2 << 20
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25
_libc: Optional[ctypes.CDLL] = None


def enabled() -> bool:
    return sys.platform.startswith("linux") and not switches.on("DSV4_NO_HUGE_PAGES")


def advise(t: torch.Tensor, collapse: bool = True) -> int:
    """Ask for 2 MB pages under t's storage (CPU only), collapsing the pages it already has unless
    `collapse` is False: the bytes of it that were marked (0 where nothing was: too small, not
    CPU, turned off, refused). Asking twice does no harm."""
    global _libc
    if t.device.type != "cpu" or not enabled():
        return 0
    storage = t.untyped_storage()
    base = storage.data_ptr()
    start = -(-base // _HUGE) * _HUGE  # only whole 2 MB pages inside the storage
    end = (base + storage.nbytes()) // _HUGE * _HUGE
    if end <= start:
        return 0
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if _libc.madvise(start, end - start, _MADV_HUGEPAGE) != 0:
        return 0
    if collapse:
        _libc.madvise(start, end - start, _MADV_COLLAPSE)  # may fail (old kernel): khugepaged does it later
    return end - start


def advise_all(tensors: Iterable[torch.Tensor]) -> int:
    """advise() each distinct storage once; the bytes marked in all."""
    seen: set[int] = set()
    marked = 0
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            marked += advise(t)
    return marked
