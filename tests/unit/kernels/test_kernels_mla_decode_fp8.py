"""mla_decode over an FP8 KV cache (`--kv-cache-dtype fp8_e4m3`): the Triton kernel loads the
packed e4m3 rows and their scales itself and matches the reference run on the dequantized cache."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4_engine import kv_quant
from dsv4_kernels import reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "heads,v_dim,rope,page_size,seq_lens,num_splits",
    [(3, 64, 16, 16, [1, 37, 70], None), (4, 512, 64, 16, [33, 5], 2)],
)
def test_triton_fp8_kv_matches_reference_on_the_dequantized_cache(
    paged_cache, device, tol, dtype, heads, v_dim, rope, page_size, seq_lens, num_splits
):
    from dsv4_kernels import triton_ops

    kv, table, lens = paged_cache(seq_lens, page_size, v_dim + rope, torch.float32)
    packed = kv_quant.quantize(kv)  # [pages, page, D + 4] uint8
    q = torch.randn(len(seq_lens), heads, v_dim + rope, generator=torch.Generator().manual_seed(3)).to(dtype)
    q = q.to(device)
    scale = 1 / math.sqrt(v_dim + rope)
    want = reference.mla_decode(q, kv_quant.dequantize(packed, dtype), table, lens, scale, v_dim)
    got = triton_ops.mla_decode(q, packed, table, lens, scale, v_dim, num_splits=num_splits)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **tol[dtype])


def test_fp8_rows_of_the_wrong_width_are_refused(paged_cache, device):
    from dsv4_kernels import triton_ops

    kv, table, lens = paged_cache([5], 16, 80, torch.float32)
    q = torch.zeros(1, 2, 80, device=device)
    with pytest.raises(ValueError, match="FP8 kv_cache rows"):
        triton_ops.mla_decode(q, kv_quant.quantize(kv[..., :76]), table, lens, 0.1, 64)
