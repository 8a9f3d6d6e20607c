"""The native per-head MLA projections (dsv4_kernels.cpu_mla_absorb) against their torch forms
(bmm + transpose + cat; bmm + transpose) and against fp64: the same values up to fp32 rounding
(within the error bound of an in-order fp32 sum), on strided queries and widths that leave
vector and register-tile tails."""

import pytest
import torch

from dsv4_kernels import cpu_mla_absorb

pytestmark = pytest.mark.skipif(not cpu_mla_absorb.available(), reason="no native build here")

SHAPES = [  # T, H, N (nope), R (rope), C (latent), V
    (0, 8, 64, 64, 512, 64),
    (1, 8, 64, 64, 512, 64),
    (5, 3, 16, 8, 80, 24),  # a 16-wide vector tail, no full 64-column tile in V
    (33, 8, 128, 64, 512, 128),  # a token-tile tail (33 = 8 x 4 + 1)
    (7, 2, 5, 3, 19, 7),  # scalar tails everywhere
    (64, 1, 64, 64, 512, 64),
]


def _weights(H, N, C, V, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(H, N, C, generator=g) * 0.1, torch.randn(H, V, C, generator=g) * 0.1


@pytest.mark.parametrize("T,H,N,R,C,V", SHAPES)
def test_absorb_q_is_the_torch_form_on_a_strided_query(T, H, N, R, C, V):
    w_uk, _ = _weights(H, N, C, V, T + H)
    g = torch.Generator().manual_seed(1)
    proj = torch.randn(T, H * (N + R) + 3, generator=g)  # a wider projection: token stride != H * (N + R)
    q = proj[:, 3:].view(T, H, N + R)
    assert cpu_mla_absorb.supports(q, w_uk, torch.empty(H, C, V))
    got = cpu_mla_absorb.absorb_q(q, w_uk)
    ref = torch.cat([torch.bmm(q[:, :, :N].transpose(0, 1), w_uk).transpose(0, 1), q[:, :, N:]], dim=-1)
    exact = torch.einsum("thn,hnc->thc", q[:, :, :N].double(), w_uk.double())
    assert got.shape == (T, H, C + R) and got.is_contiguous()
    assert torch.equal(got[:, :, C:], q[:, :, N:])  # the rope part copied as it is
    tol = 4 * N * torch.finfo(torch.float32).eps * (q.abs().max().item() if T else 0) * w_uk.abs().max().item()
    assert (got[:, :, :C].double() - exact).abs().max().item() <= tol if T else True
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    packed = cpu_mla_absorb.pack_w_uk(w_uk)
    if C % cpu_mla_absorb.TILE or C == cpu_mla_absorb.TILE:
        assert packed is None
    else:  # the packed weights: the same products in the same order, so the same bits
        assert torch.equal(cpu_mla_absorb.absorb_q(q, w_uk, packed), got)


@pytest.mark.parametrize("T,H,N,R,C,V", SHAPES)
def test_apply_uv_is_the_torch_form_on_a_strided_output(T, H, N, R, C, V):
    _, w_uv = _weights(H, N, C, V, T + 2 * H)
    w_uvt = w_uv.transpose(1, 2).contiguous()
    g = torch.Generator().manual_seed(2)
    o = torch.randn(H, T, C, generator=g).transpose(0, 1)  # [T, H, C] with head-major strides
    got = cpu_mla_absorb.apply_uv(o, w_uvt)
    ref = torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
    exact = torch.einsum("thc,hvc->thv", o.double(), w_uv.double())
    assert got.shape == (T, H, V) and got.is_contiguous()
    if T:
        tol = 4 * C * torch.finfo(torch.float32).eps * o.abs().max().item() * w_uv.abs().max().item()
        assert (got.double() - exact).abs().max().item() <= tol  # fp32 summation's error bound
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_supports_only_what_it_takes():
    q, w_uk, w_uvt = torch.randn(2, 8, 128), torch.randn(8, 64, 512), torch.randn(8, 512, 64)
    assert cpu_mla_absorb.supports(q, w_uk, w_uvt)
    assert not cpu_mla_absorb.supports(q.double(), w_uk, w_uvt)
    assert not cpu_mla_absorb.supports(q, w_uk.transpose(1, 2).contiguous().transpose(1, 2), w_uvt)
    assert not cpu_mla_absorb.supports(q.transpose(1, 2), w_uk, w_uvt)  # channels not contiguous
    assert not cpu_mla_absorb.supports(torch.randn(2, 4, 128), w_uk, w_uvt)  # head count differs
    assert not cpu_mla_absorb.supports(q, w_uk, torch.randn(8, 256, 64))  # latent width differs
