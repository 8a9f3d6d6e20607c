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
