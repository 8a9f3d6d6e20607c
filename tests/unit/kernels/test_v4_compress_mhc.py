"""V4 compressor pooling (with and without the overlap series, with and without a preceding
window) and the fused mHC pre/post, Triton against the torch reference."""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels import reference_v4 as ref
from dsv4_kernels.triton_kernels import v4_compress as ck
from dsv4_kernels.triton_kernels import v4_mhc as mk


@pytest.mark.parametrize("overlap,has_prev,rate,hd,windows", [
    (True, False, 4, 64, 5),   # CSA from position 0: window 0 has no predecessor
    (True, True, 4, 64, 3),    # CSA mid-sequence
    (False, False, 8, 64, 4),  # HCA
    (False, False, 128, 48, 2),  # HCA's real rate, a width that is not a power of two
])
def test_compress_pool_matches_reference(device, tol, overlap, has_prev, rate, hd, windows):
    gen = torch.Generator().manual_seed(rate + windows)
    width = 2 * hd if overlap else hd
    rows = (windows + (1 if overlap and has_prev else 0)) * rate
    kv = torch.randn(rows, width, generator=gen).to(device)
    gate = (torch.randn(rows, width, generator=gen) * 2).to(device)
    ape = torch.randn(rate, width, generator=gen).to(device)
    norm = (1 + 0.1 * torch.randn(hd, generator=gen)).to(device)
    want = ref.v4_compress_pool(kv, gate, ape, norm, windows, rate, overlap, has_prev, 1e-6)
    got = ck.v4_compress_pool(kv, gate, ape, norm, windows, rate, overlap, has_prev, 1e-6)
    torch.testing.assert_close(got, want, **tol[torch.float32])


def test_compress_pool_bf16(device, tol):
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(12, 128, generator=gen).to(torch.bfloat16).to(device)
    gate = torch.randn(12, 128, generator=gen).to(torch.bfloat16).to(device)
    ape = torch.randn(4, 128, generator=gen).to(device)
    norm = torch.ones(64, device=device)
    want = ref.v4_compress_pool(kv.float(), gate.float(), ape, norm, 2, 4, True, True, 1e-6)
    got = ck.v4_compress_pool(kv, gate, ape, norm, 2, 4, True, True, 1e-6)
    torch.testing.assert_close(got.float(), want, **tol[torch.bfloat16])


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


def test_hc_post_matches_reference(device, tol):
    x, fn, base, scale = make_hc(device, 4, 4, 200)
    post, comb, _ = ref.v4_hc_pre(x, fn, base, scale, 1e-6, 1e-6, 20)
    out = torch.randn(4, 200).to(device)
    torch.testing.assert_close(mk.v4_hc_post(x, out, post, comb), ref.v4_hc_post(x, out, post, comb),
                               **tol[torch.float32])


def test_hc_v4_flash_width(device):
    """V4-Flash: 4 streams of 4096."""
    x, fn, base, scale = make_hc(device, 2, 4, 4096)
    for g, w in zip(mk.v4_hc_pre(x, fn, base, scale, 1e-6, 1e-6, 20), ref.v4_hc_pre(x, fn, base, scale, 1e-6, 1e-6, 20)):
        torch.testing.assert_close(g, w, atol=5e-5, rtol=5e-5)
