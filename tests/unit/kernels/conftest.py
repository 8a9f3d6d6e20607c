"""Kernel tests run the Triton kernels compiled on a CUDA machine, and under Triton's CPU
interpreter everywhere else. The interpreter is chosen when a kernel module is imported, so
TRITON_INTERPRET must be set here, before any test imports dsv4_kernels.triton_ops."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

# fp32: full-precision dots on both sides; bf16: rounding of inputs and outputs (the
# interpreter also truncates instead of rounding when casting to bf16).
TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
if torch.cuda.is_available():
    # Compiled, tl.exp/exp2, rsqrt, sigmoid and / are approximate instructions (a few ulp each,
    # compounded through softmax merges and normalisations); the interpreter computes them exactly.
    TOLERANCE[torch.float32] = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def tol():
    return TOLERANCE


@pytest.fixture(scope="session")
def paged_cache(device):
    """paged_cache(seq_lens, page_size, dim, dtype) -> (kv, block_table, seq_lens).

    kv is one layer of a page-major pool [pages, layers, page_size, dim] (a strided view, as
    the engine passes it); pages are handed out in shuffled order, and table slots past a
    request's last page hold an out-of-range page id that no kernel may read.
    """

    def make(seq_lens, page_size, dim, dtype, num_layers=3, layer=1, seed=0):
        gen = torch.Generator().manual_seed(seed)
        pages_needed = [-(-n // page_size) for n in seq_lens]
        num_pages = sum(pages_needed) + 3
        pool = torch.randn(num_pages, num_layers, page_size, dim, generator=gen).to(dtype).to(device)
        order = torch.randperm(num_pages, generator=gen)
        table = torch.full((len(seq_lens), max(pages_needed) + 1), num_pages + 1000, dtype=torch.int32)
        used = 0
        for b, n in enumerate(pages_needed):
            table[b, :n] = order[used : used + n].to(torch.int32)
            used += n
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        return pool[:, layer], table.to(device), lens.to(device)

    return make
