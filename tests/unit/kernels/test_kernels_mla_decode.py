"""mla_decode: the torch reference against a per-token fp64 formulation, and the Triton kernel
against the reference (paged, shuffled, strided cache; odd lengths and head counts)."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4_kernels import reference


def naive_mla_decode(q, kv, block_table, seq_lens, sm_scale, v_dim):
    """Token by token: look each cached row up through the block table, softmax in fp64."""
    page_size = kv.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], v_dim, dtype=torch.float64)
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        rows = []
        for pos in range(n):
            page = int(block_table[b, pos // page_size])
            rows.append(kv[page, pos % page_size].double().cpu())
        if not rows:
            continue
        keys = torch.stack(rows)  # [n, D]
        for h in range(q.shape[1]):
            scores = (keys @ q[b, h].double().cpu()) * sm_scale
            probs = torch.softmax(scores, dim=0)
            out[b, h] = probs @ keys[:, :v_dim]
    return out


def make_query(batch, heads, dim, dtype, device, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, dim, generator=gen).to(dtype).to(device)


@pytest.mark.parametrize(
    "heads,v_dim,rope,page_size,seq_lens",
    [(3, 64, 16, 16, [1, 37, 70]), (16, 512, 64, 64, [130, 1]), (5, 64, 16, 8, [0, 9])],
)
def test_reference_matches_per_token_softmax(paged_cache, device, heads, v_dim, rope, page_size, seq_lens):
    kv, table, lens = paged_cache(seq_lens, page_size, v_dim + rope, torch.float32)
    q = make_query(len(seq_lens), heads, v_dim + rope, torch.float32, device)
    scale = 1 / math.sqrt(v_dim + rope)
    got = reference.mla_decode(q, kv, table, lens, scale, v_dim)
    want = naive_mla_decode(q, kv, table, lens, scale, v_dim)
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-5, rtol=1e-5)
    assert got.dtype == torch.float32 and got.shape == (len(seq_lens), heads, v_dim)


def test_reference_in_request_chunks_is_bit_for_bit_the_whole_batch(paged_cache, device, monkeypatch):
    """A few requests per tile (DECODE_TILE_BYTES) changes the memory traffic, not one bit."""
    lens_list = [1, 37, 70, 0, 16, 5, 90]
    kv, table, lens = paged_cache(lens_list, 16, 80, torch.float32)
    q = make_query(len(lens_list), 4, 80, torch.float32, device)
    monkeypatch.setattr(reference, "DECODE_TILE_BYTES", 1 << 62)
    whole = reference.mla_decode(q, kv, table, lens, 0.125, 64)
    for rows in (1, 2, 3):  # the tile of `rows` requests: rows * one block of keys
        monkeypatch.setattr(reference, "DECODE_TILE_BYTES", rows * min(table.shape[1], 16) * 16 * 80 * 4)
        assert torch.equal(reference.mla_decode(q, kv, table, lens, 0.125, 64), whole)


def test_reference_keeps_bf16_and_handles_empty_batch(paged_cache, device):
    kv, table, lens = paged_cache([5], 4, 80, torch.bfloat16)
    q = make_query(1, 2, 80, torch.bfloat16, device)
    assert reference.mla_decode(q, kv, table, lens, 0.1, 64).dtype == torch.bfloat16
    empty = reference.mla_decode(q[:0], kv, table[:0], lens[:0], 0.1, 64)
    assert empty.shape == (0, 2, 64)


# (heads, v_dim, rope, page_size, seq_lens, num_splits): seq_len 1, lengths off the page size,
# heads not a power of two, more slices than a short request has tiles, both latent widths,
# and 128 heads (64 heads a program at the real width).
CASES = [
    (3, 64, 16, 16, [1, 37, 70], None),
    (16, 64, 16, 8, [5, 100], 3),
    (4, 64, 16, 16, [130], 8),
    (16, 512, 64, 64, [1, 70], None),
    (128, 512, 64, 16, [33], 2),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,v_dim,rope,page_size,seq_lens,num_splits", CASES)
def test_triton_matches_reference(paged_cache, device, tol, dtype, heads, v_dim, rope, page_size, seq_lens, num_splits):
    from dsv4_kernels import triton_ops

    kv, table, lens = paged_cache(seq_lens, page_size, v_dim + rope, dtype)
    q = make_query(len(seq_lens), heads, v_dim + rope, dtype, device)
    scale = 1 / math.sqrt(v_dim + rope)
    want = reference.mla_decode(q, kv, table, lens, scale, v_dim)
    got = triton_ops.mla_decode(q, kv, table, lens, scale, v_dim, num_splits=num_splits)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **tol[dtype])


def test_triton_split_count_does_not_change_the_result(paged_cache, device, tol):
    from dsv4_kernels import triton_ops

    kv, table, lens = paged_cache([97, 3], 16, 80, torch.float32)
    q = make_query(2, 4, 80, torch.float32, device)
    one = triton_ops.mla_decode(q, kv, table, lens, 0.125, 64, num_splits=1)
    many = triton_ops.mla_decode(q, kv, table, lens, 0.125, 64, num_splits=5)
    torch.testing.assert_close(one, many, **tol[torch.float32])


def test_triton_padding_request_with_seq_len_zero_gives_zeros(paged_cache, device):
    from dsv4_kernels import triton_ops

    kv, table, lens = paged_cache([0, 20], 16, 80, torch.float32)
    q = make_query(2, 3, 80, torch.float32, device)
    got = triton_ops.mla_decode(q, kv, table, lens, 0.125, 64, num_splits=2)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    torch.testing.assert_close(got, reference.mla_decode(q, kv, table, lens, 0.125, 64), atol=2e-5, rtol=1e-5)


def test_default_split_count_fills_one_wave(monkeypatch):
    import dsv4_kernels.triton_kernels.mla_decode as mod

    monkeypatch.setattr(mod, "sm_count", lambda device: 132)  # an H100/H200
    cfg = mod.DecodeConfig(programs_per_sm=2)
    gpu = torch.device("cuda", 0)
    assert mod.default_num_splits(64, 1, 32768, cfg, gpu) == 4  # 256 programs on 264 slots
    assert mod.default_num_splits(1, 1, 32768, cfg, gpu) == mod.MAX_SPLITS
    assert mod.default_num_splits(1, 1, 40, cfg, gpu) == 2  # no more slices than tiles
    assert mod.default_num_splits(512, 8, 32768, cfg, gpu) == 1
