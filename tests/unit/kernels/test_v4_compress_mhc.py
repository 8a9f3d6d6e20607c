"""V4 compressor pooling (with and without the overlap series, with and without a preceding
window) and the fused mHC pre/post, Triton against the torch reference."""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels import reference_v4 as ref
from dsv4_kernels.triton_kernels import v4_compress as ck
from dsv4_kernels.triton_kernels import v4_mhc as mk


def make_windows(device, dtype, n, rate, hd, overlap, seed=0):
    """Windows as the model gathers them: [kv | gate] rows of a stage ring, so kv and gate are
    strided views of one [N, rate, 2 * width] tensor; w_ids include window 0 (no predecessor)."""
    gen = torch.Generator().manual_seed(seed)
    width = 2 * hd if overlap else hd
    win = torch.randn(n, rate, 2 * width, generator=gen)
    win[..., width:] *= 2
    prev = torch.randn(n, rate, 2 * width, generator=gen)
    ape = torch.randn(rate, width, generator=gen)
    norm = 1 + 0.1 * torch.randn(hd, generator=gen)
    w_ids = torch.arange(n) * 3  # 0, 3, 6, ...
    cast = lambda x: x.to(dtype).to(device)  # noqa: E731
    win, prev = cast(win), cast(prev)
    args = (
        win[..., :width],
        win[..., width:],
        prev[..., :width] if overlap else None,
        prev[..., width:] if overlap else None,
        ape.to(device),
        norm.to(device),
        w_ids.to(device),
        1e-6,
    )
    return args


@pytest.mark.parametrize(
    "overlap,rate,hd,n",
    [
        (True, 4, 64, 5),  # CSA: window 0 has no predecessor, the others do
        (False, 8, 64, 4),  # HCA
        (False, 128, 48, 2),  # HCA's real rate, a width that is not a power of two
        (True, 4, 128, 3),  # the indexer's compressor
    ],
)
def test_compress_pool_matches_reference(device, tol, overlap, rate, hd, n):
    args = make_windows(device, torch.float32, n, rate, hd, overlap, seed=rate + n)
    torch.testing.assert_close(ck.v4_compress_pool(*args), ref.v4_compress_pool(*args), **tol[torch.float32])


def test_compress_pool_bf16(device, tol):
    args = make_windows(device, torch.bfloat16, 3, 4, 64, True)
    want = ref.v4_compress_pool(*[a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args])
    torch.testing.assert_close(ck.v4_compress_pool(*args).float(), want, **tol[torch.bfloat16])


def make_hc(device, T, hc, dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, hc, dim, generator=gen).to(device)
    fn = (torch.randn((2 + hc) * hc, hc * dim, generator=gen) * (hc * dim) ** -0.5).to(device)
    base = (torch.randn((2 + hc) * hc, generator=gen) * 0.5).to(device)
    scale = torch.tensor([0.7, 1.3, 2.0]).to(device)
    return x, fn, base, scale


@pytest.mark.parametrize("T,hc,dim", [(5, 4, 128), (3, 4, 300), (2, 3, 64)])
def test_hc_pre_matches_reference(device, T, hc, dim):
    x, fn, base, scale = make_hc(device, T, hc, dim)
    want = ref.v4_hc_pre(x, fn, base, scale, 1e-6, 1e-6, 20)
    got = mk.v4_hc_pre(x, fn, base, scale, 1e-6, 1e-6, 20)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)
    # Sinkhorn made comb (nearly) doubly stochastic
    torch.testing.assert_close(got[1].sum(-2), torch.ones_like(got[1][:, 0]), atol=1e-3, rtol=0)


@pytest.mark.parametrize("T,hc,dim,splits", [(1, 4, 300, 3), (2, 3, 64, 2)])
def test_hc_pre_split_over_columns_matches_reference(device, T, hc, dim, splits):
    """Small batches: the hc * dim columns reduced by several programs, partials summed by a
    second kernel that also writes the collapsed input in column blocks."""
    x, fn, base, scale = make_hc(device, T, hc, dim, seed=T + dim)
    want = ref.v4_hc_pre(x, fn, base, scale, 1e-6, 1e-6, 20)
    got = mk.v4_hc_pre(x, fn, base, scale, 1e-6, 1e-6, 20, num_splits=splits)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)


def test_hc_pre_splits_fill_the_device_at_small_batch():
    # V4-Flash at batch 1 (one token block) on 132 SMs: 64 programs of 4 tiles each
    assert mk.hc_pre_splits(1, 16384, 64, 132) == (64, 256)
    # batch 64 (16 blocks of 4): 8 splits a block
    n, length = mk.hc_pre_splits(16, 16384, 64, 132)
    assert n == 8 and n * length >= 16384
    # blocks that fill half the device: the fused kernel
    assert mk.hc_pre_splits(66, 16384, 64, 132) == (1, 16384)
    for blocks, flat in ((1, 100), (3, 1000), (10, 16384)):
        n, length = mk.hc_pre_splits(blocks, flat, 64, 132)
        assert n * length >= flat and (n - 1) * length < flat and length % 64 == 0


def test_hc_post_matches_reference(device, tol):
    x, fn, base, scale = make_hc(device, 4, 4, 200)
    post, comb, _ = ref.v4_hc_pre(x, fn, base, scale, 1e-6, 1e-6, 20)
    out = torch.randn(4, 200).to(device)
    torch.testing.assert_close(
        mk.v4_hc_post(x, out, post, comb), ref.v4_hc_post(x, out, post, comb), **tol[torch.float32]
    )


def test_hc_v4_flash_width(device):
    """V4-Flash: 4 streams of 4096."""
    x, fn, base, scale = make_hc(device, 2, 4, 4096)
    args = (x, fn, base, scale, 1e-6, 1e-6, 20)
    for g, w in zip(mk.v4_hc_pre(*args), ref.v4_hc_pre(*args)):
        torch.testing.assert_close(g, w, atol=5e-5, rtol=5e-5)
