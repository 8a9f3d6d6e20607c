"""mla_extend (chunked prefill): the torch reference against a per-token causal fp64
formulation, and the Triton kernel against the reference."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4_kernels import reference


def naive_mla_extend(q, kv, block_table, seq_lens, extend_lens, sm_scale, v_dim):
    """New token i of request b sits at position seq_len - ext + i and sees positions 0..that."""
    page_size = kv.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], v_dim, dtype=torch.float64)
    t = 0
    for b in range(len(seq_lens)):
        n, ext = int(seq_lens[b]), int(extend_lens[b])
        keys = (
            torch.stack([kv[int(block_table[b, p // page_size]), p % page_size].double().cpu() for p in range(n)])
            if n
            else None
        )
        for i in range(ext):
            pos = n - ext + i
            visible = keys[: pos + 1]
            for h in range(q.shape[1]):
                probs = torch.softmax((visible @ q[t, h].double().cpu()) * sm_scale, dim=0)
                out[t, h] = probs @ visible[:, :v_dim]
            t += 1
    return out


def make_inputs(paged_cache, device, dtype, heads, v_dim, rope, page_size, seq_lens, extend_lens, seed=2):
    kv, table, lens = paged_cache(seq_lens, page_size, v_dim + rope, dtype)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(extend_lens), heads, v_dim + rope, generator=gen).to(dtype).to(device)
    ext = torch.tensor(extend_lens, dtype=torch.int32, device=device)
    return q, kv, table, lens, ext, 1 / math.sqrt(v_dim + rope)


# (heads, v_dim, rope, page_size, seq_lens, extend_lens): a whole prompt, a chunk after a cached
# prefix, a single token, a request with nothing new, both latent widths, odd head counts.
CASES = [
    (3, 64, 16, 16, [1, 37, 70], [1, 5, 30]),
    (16, 64, 16, 8, [40, 17, 9], [40, 0, 2]),
    (5, 512, 64, 64, [70, 9], [6, 9]),
]


@pytest.mark.parametrize("heads,v_dim,rope,page_size,seq_lens,extend_lens", CASES)
def test_reference_matches_per_token_causal_softmax(
    paged_cache, device, heads, v_dim, rope, page_size, seq_lens, extend_lens
):
    q, kv, table, lens, ext, scale = make_inputs(
        paged_cache, device, torch.float32, heads, v_dim, rope, page_size, seq_lens, extend_lens
    )
    got = reference.mla_extend(q, kv, table, lens, ext, scale, v_dim)
    want = naive_mla_extend(q, kv, table, lens, ext, scale, v_dim)
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-5, rtol=1e-5)


def test_reference_extend_of_one_token_is_decode(paged_cache, device):
    q, kv, table, lens, ext, scale = make_inputs(paged_cache, device, torch.float32, 4, 64, 16, 16, [23, 51], [1, 1])
    torch.testing.assert_close(
        reference.mla_extend(q, kv, table, lens, ext, scale, 64),
        reference.mla_decode(q, kv, table, lens, scale, 64),
    )


def test_reference_rejects_extend_lens_that_do_not_cover_q(paged_cache, device):
    q, kv, table, lens, ext, scale = make_inputs(paged_cache, device, torch.float32, 2, 64, 16, 16, [8], [4])
    with pytest.raises(ValueError, match="extend_lens"):
        reference.mla_extend(q[:3], kv, table, lens, ext, scale, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,v_dim,rope,page_size,seq_lens,extend_lens", CASES)
def test_triton_matches_reference(
    paged_cache, device, tol, dtype, heads, v_dim, rope, page_size, seq_lens, extend_lens
):
    from dsv4_kernels import triton_ops

    q, kv, table, lens, ext, scale = make_inputs(
        paged_cache, device, dtype, heads, v_dim, rope, page_size, seq_lens, extend_lens
    )
    want = reference.mla_extend(q, kv, table, lens, ext, scale, v_dim)
    got = triton_ops.mla_extend(q, kv, table, lens, ext, scale, v_dim)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **tol[dtype])


def test_triton_rejects_extend_lens_that_do_not_cover_q(paged_cache, device):
    from dsv4_kernels import triton_ops

    q, kv, table, lens, ext, scale = make_inputs(paged_cache, device, torch.float32, 2, 64, 16, 16, [8], [4])
    with pytest.raises(ValueError, match="extend_lens"):
        triton_ops.mla_extend(q[:3], kv, table, lens, ext, scale, 64)
