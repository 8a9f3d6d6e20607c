"""The native mHC pre step (dsv4_kernels.cpu_mhc) against the model's torch form of it."""

import pytest
import torch

from dsv4_kernels import cpu_mhc


def _torch_tail(mixes, base, scale, x, hc_eps, iters):
    hc = x.shape[1]
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return post, comb, torch.einsum("tj,tjd->td", pre, x)


@pytest.mark.skipif(not cpu_mhc.available(), reason="no C compiler on this machine")
@pytest.mark.parametrize("T,hc,D", [(1, 4, 64), (7, 4, 128), (33, 2, 48)])
def test_native_tail_matches_torch(T, hc, D):
    g = torch.Generator().manual_seed(T)
    mixes = torch.randn(T + 3, (2 + hc) * hc, generator=g)[:T]  # rows of a wider buffer: strided
    base = torch.randn((2 + hc) * hc, generator=g)
    scale = torch.rand(3, generator=g) + 0.5
    x = torch.randn(T, hc, D, generator=g) * 4
    got = cpu_mhc.hc_pre_tail(mixes, base, scale, x, 1e-6, 20)
    want = _torch_tail(mixes, base, scale, x, 1e-6, 20)
    for a, b in zip(got, want):
        # float32 elementwise math in both; exp and the sums' order differ by an ulp or so
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)
    # the rows of a doubly stochastic matrix after Sinkhorn: columns sum to ~1
    torch.testing.assert_close(got[1].sum(-2), torch.ones(T, hc), rtol=0, atol=1e-4)


@pytest.mark.skipif(not cpu_mhc.available(), reason="no C compiler on this machine")
@pytest.mark.parametrize("T,hc,D", [(1, 4, 64), (9, 4, 128), (5, 2, 48)])
def test_native_post_matches_torch(T, hc, D):
    """The post step against the model's torch form (baddbmm): the same products, the sums in
    j order here where the GEMM may fuse them, so an ulp or so apart."""
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, hc, D, generator=g) * 4
    out = torch.randn(T + 2, D, generator=g)[1 : T + 1]  # a view inside a wider buffer
    post = torch.rand(T, hc, generator=g) * 2
    comb = torch.softmax(torch.randn(T, hc, hc, generator=g), -1)
    want = torch.baddbmm(post.unsqueeze(-1) * out.unsqueeze(-2), comb.transpose(-1, -2), x)
    got = cpu_mhc.hc_post(x, out, post, comb)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=4e-6)
