"""The native V4 decode attention (dsv4_kernels.cpu_v4_attention) against the torch form: keys
gathered from the ring and the paged entries, masked by position and visibility, softmax with
the sink as one more logit."""

import pytest
import torch

from dsv4_kernels import cpu_v4_attention


def _torch_form(q, kv, ring, slots, t, sink, scale, store, bt, visible, rate, page_size):
    B, H, hd = q.shape
    W = ring.shape[1]
    ring_pos = (t[:, None] - 1) - torch.remainder(t[:, None] - 1 - torch.arange(W), W)
    kpos = torch.cat([ring_pos, t[:, None]], 1)
    allowed = (kpos <= t[:, None]) & (kpos > t[:, None] - W) & (kpos >= 0)
    keys = torch.cat([ring[slots], kv[:, None]], 1)
    if visible is not None:
        w = torch.arange(visible.shape[1])
        page, off = (w * rate) // page_size, w % store.shape[1]
        keys = torch.cat([keys, store[bt[:, page].long(), off[None].expand(B, -1)]], 1)
        allowed = torch.cat([allowed, visible], 1)
    logits = torch.einsum("bhd,bkd->bhk", q, keys) * scale
    logits = logits.masked_fill(~allowed[:, None], float("-inf"))
    full = torch.cat([logits, sink.view(1, H, 1).expand(B, H, 1)], -1).softmax(-1)[..., :-1]
    return torch.einsum("bhk,bkd->bhd", full, keys)


@pytest.mark.skipif(not cpu_v4_attention.available(), reason="no C compiler on this machine")
@pytest.mark.parametrize("entries", [False, True])
@pytest.mark.parametrize("H,hd,W", [(4, 64, 8), (3, 40, 5)])
def test_native_decode_matches_torch(entries, H, hd, W):
    g = torch.Generator().manual_seed(H * W)
    B, rows, layers, rate, page_size, epp, pages = 6, 9, 3, 4, 16, 4, 40
    ring_state = torch.randn(rows, layers, W, hd, generator=g)
    ring = ring_state[:, 1]  # one layer of the ring: rows strided by the layers
    slots = torch.randperm(rows, generator=g)[:B]
    t = torch.tensor([0, 1, W - 1, W, 37, 61])  # before, at and past a full window
    q = torch.randn(B, H, hd, generator=g)
    kv = torch.randn(B, hd, generator=g)
    sink = torch.randn(H, generator=g)
    scale = hd**-0.5
    store = bt = visible = None
    if entries:
        store = torch.randn(pages, layers, epp, hd, generator=g)[:, 2]
        bt = torch.randperm(pages, generator=g)[: B * 5].view(B, 5).int()
        C = int((t.max() + 1) // rate)
        visible = torch.arange(C)[None] < ((t + 1) // rate)[:, None]
        visible &= torch.rand(B, C, generator=g) < 0.6  # an indexer's pick: some closed entries hidden
    got = cpu_v4_attention.decode(q, kv, ring, slots, t, sink, scale, store, bt, visible, rate, page_size)
    want = _torch_form(q, kv, ring, slots, t, sink, scale, store, bt, visible, rate, page_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _torch_extend(q, ext, row, n, start, W, sink, scale, entries, visible):
    """One query at a time: its last W positions (>= 0) from ext, then its visible entries."""
    out = torch.zeros_like(q)
    for b in range(ext.shape[0]):
        for m in range(int(n[b])):
            p = int(start[b]) + m
            keys = [ext[b, m + 1 + k] for k in range(W) if p - W + 1 + k >= 0]
            if visible is not None:
                keys += [entries[b, w] for w in range(visible.shape[2]) if visible[b, m, w]]
            keys = torch.stack(keys)
            r = int(row[b]) + m
            logits = torch.cat([q[r] @ keys.T * scale, sink[:, None]], 1)
            out[r] = logits.softmax(-1)[:, :-1] @ keys
    return out


@pytest.mark.skipif(not cpu_v4_attention.available(), reason="no C compiler on this machine")
@pytest.mark.parametrize("entries", [False, True])
def test_native_extend_matches_torch(entries):
    g = torch.Generator().manual_seed(3)
    H, hd, W, C = 4, 64, 8, 6
    n = torch.tensor([5, 1, 12])  # a chunk, a decode token, a longer chunk
    start = torch.tensor([0, 30, 3])  # a fresh prompt, then chunks after earlier ones
    row = torch.tensor([0, 5, 6])
    Lmax, T = int(n.max()), int(n.sum())
    q = torch.randn(T, H, hd, generator=g)
    ext = torch.randn(3, W + Lmax, hd, generator=g)
    sink = torch.randn(H, generator=g)
    ent = torch.randn(3, C, hd, generator=g) if entries else None
    vis = (torch.rand(3, Lmax, C, generator=g) < 0.5) if entries else None
    got = torch.full((T + 1, H, hd), 7.0)
    cpu_v4_attention.extend(q, ext, row, n, start, W, sink, hd**-0.5, got, ent, vis)
    want = _torch_extend(q, ext, row, n, start, W, sink, hd**-0.5, ent, vis)
    torch.testing.assert_close(got[:T], want, rtol=1e-5, atol=1e-5)
    assert (got[T] == 7.0).all()  # the scratch row past the batch is not written


@pytest.mark.skipif(not cpu_v4_attention.available(), reason="no C compiler on this machine")
@pytest.mark.parametrize("weighted,norm,conj", [(True, True, False), (False, True, False), (False, False, True)])
def test_native_rms_rope_matches_torch(weighted, norm, conj):
    """The attention's norm + rope pass against v4_layers' torch forms, on a strided slice of a
    projection's output as the model passes it."""
    from dsv4_kernels.v4_torch import apply_rope, rms, rope_table, unweighted_rms

    g = torch.Generator().manual_seed(int(weighted) + 2 * int(norm))
    T, n, D, half = 9, 3, 64, 8
    wide = torch.randn(T, n * D + 24, generator=g) * 3
    x = wide[:, 5 : 5 + n * D].view(T, n, D)  # rows 88 + n * D apart, not contiguous
    w = torch.rand(D, generator=g) + 0.5 if weighted else None
    table = rope_table(torch.tensor([0, 1, 2, 7, 8, 63, 64, 500, 1023]), 1.0 / (10000 ** (torch.arange(half) / half)))
    got = cpu_v4_attention.rms_rope(x, w, 1e-6, table[0], norm=norm, conj=conj)
    want = x.clone()
    if norm:
        want = rms(want, w, 1e-6) if weighted else unweighted_rms(want, 1e-6)
    want = apply_rope(want, table, conj=conj)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
