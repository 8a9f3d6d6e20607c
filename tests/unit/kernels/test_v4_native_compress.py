"""The native V4 compressor pooling (dsv4_kernels.cpu_v4_compress) against the model's torch form
(V4Compressor.pool_split), for the overlapping CSA compressor and the plain HCA one."""

import pytest
import torch

from dsv4_engine.layers.v4_compressor import V4Compressor
from dsv4_engine.layers.v4_step import V4Backend
from dsv4_kernels import cpu_v4_compress
from dsv4_kernels.api import get_ops


@pytest.mark.skipif(not cpu_v4_compress.available(), reason="no C compiler on this machine")
@pytest.mark.parametrize("overlap", [True, False])
def test_native_pool_matches_torch(overlap):
    g = torch.Generator().manual_seed(int(overlap))
    N, rate, hd, half_rd = 7, 4, 64, 8
    width = 2 * hd if overlap else hd
    win = torch.randn(N, rate, 2 * width, generator=g)
    prev = torch.randn(N, rate, 2 * width, generator=g) if overlap else None
    w_ids = torch.tensor([0, 1, 2, 5, 31, 64, 200])  # window 0 has no predecessor
    ape = torch.randn(rate, width, generator=g)
    norm_w = torch.rand(hd, generator=g) + 0.5
    inv_freq = 1.0 / (160000 ** (torch.arange(half_rd) / half_rd))
    got = cpu_v4_compress.pool_windows(win, prev, w_ids, ape, norm_w, 1e-6, inv_freq, rate)
    backend = V4Backend(type("Cfg", (), {"rms_norm_eps": 1e-6})(), get_ops("torch"), inv_freq={"compress": inv_freq})
    form = V4Compressor(None, None, ape, norm_w, rate, overlap, "stage", "store", "comp", backend)
    pk, pg = (None, None) if prev is None else (prev[..., :width], prev[..., width:])
    want = form.pool_split(win[..., :width], win[..., width:], pk, pg, w_ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
