"""V4 attention (decode and extend) against the torch reference: sliding window from the ring
plus the chunk's own keys, CSA picks and HCA entries read in place from shuffled pages, sinks."""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels import reference_v4 as ref
from dsv4_kernels.triton_kernels import v4_attention as tk


def make_case(
    device, dtype, *, heads, hd, window, rate, page_size, positions, extend_lens, kind, top_k=4, max_requests=6, seed=0
):
    """Random q/kv, a garbage-filled ring and paged store, shuffled pages, and CSA picks drawn
    from each query's visible entries (padded with -1)."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.tensor(positions, dtype=torch.int64)
    lens = torch.tensor(extend_lens, dtype=torch.int64)
    T, B = int(lens.sum()), len(extend_lens)
    ends = [int(positions[int(lens[: b + 1].sum()) - 1]) + 1 for b in range(B)]
    q = torch.randn(T, heads, hd, generator=gen)
    kv = torch.randn(T, hd, generator=gen)
    ring = torch.randn(max_requests, window, hd, generator=gen)
    slot_ids = torch.randperm(max_requests, generator=gen)[:B]
    sink = torch.randn(heads, generator=gen)
    pages_needed = [-(-e // page_size) for e in ends]
    epp = max(1, page_size // rate)
    num_pages = sum(pages_needed) + 2
    store = torch.randn(num_pages, 2, epp, hd, generator=gen)[:, 1]  # one layer of a page-major pool
    order = torch.randperm(num_pages, generator=gen)
    table = torch.full((B, max(pages_needed) + 1), num_pages + 999, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_needed):
        table[b, :n] = order[used : used + n].to(torch.int32)
        used += n
    comp_idx = None
    if kind == "csa":
        comp_idx = torch.full((T, top_k), -1, dtype=torch.int32)
        for t in range(T):
            vis = (int(positions[t]) + 1) // rate
            pick = torch.randperm(vis, generator=gen)[:top_k]
            comp_idx[t, : len(pick)] = pick.to(torch.int32)
    comp = None if kind == "swa" else store
    cast = lambda x: x.to(dtype).to(device)  # noqa: E731
    return dict(
        q=cast(q),
        kv=cast(kv),
        ring=cast(ring),
        slot_ids=slot_ids.to(device),
        positions=positions.to(device),
        extend_lens=lens.to(device),
        block_table=table.to(device),
        comp_kv=None if comp is None else cast(comp),
        comp_idx=None if comp_idx is None else comp_idx.to(device),
        sink=sink.to(device),
        sm_scale=hd**-0.5,
        rate=rate if kind != "swa" else 0,
        page_size=page_size,
    )


def decode_args(c):
    return {k: v for k, v in c.items() if k != "extend_lens"}


@pytest.mark.parametrize("kind", ["swa", "csa", "hca"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(device, tol, kind, num_splits):
    rate = {"swa": 0, "csa": 4, "hca": 8}[kind]
    c = make_case(
        device,
        torch.float32,
        heads=4,
        hd=64,
        window=8,
        rate=max(rate, 1),
        page_size=16,
        positions=[0, 5, 9, 37, 70],
        extend_lens=[1] * 5,
        kind=kind,
    )
    want = ref.v4_attention_decode(**decode_args(c))
    got = tk.v4_attention_decode(**decode_args(c), num_splits=num_splits)
    torch.testing.assert_close(got, want, **tol[torch.float32])


@pytest.mark.parametrize("kind", ["swa", "csa", "hca"])
def test_extend_matches_reference_with_more_heads_than_a_tile(device, tol, kind):
    """Chunks that start at 0, mid-window and past the window, next to a decode token; 20 heads
    (two head tiles of 16)."""
    rate = {"swa": 1, "csa": 4, "hca": 8}[kind]
    lens = [12, 5, 1, 9]
    starts = [0, 6, 40, 30]
    positions = [s + i for s, n in zip(starts, lens) for i in range(n)]
    c = make_case(
        device,
        torch.float32,
        heads=20,
        hd=64,
        window=8,
        rate=rate,
        page_size=16,
        positions=positions,
        extend_lens=lens,
        kind=kind,
    )
    assert tk.attn_config(64, 20, None, 4).block_h < 20
    want = ref.v4_attention_extend(**c)
    got = tk.v4_attention_extend(**c)
    torch.testing.assert_close(got, want, **tol[torch.float32])
    # the same tokens in split mode agree too
    torch.testing.assert_close(tk.v4_attention_extend(**c, num_splits=2), want, **tol[torch.float32])


def test_decode_of_each_token_equals_extend_of_chunk_of_one(device, tol):
    c = make_case(
        device,
        torch.float32,
        heads=4,
        hd=64,
        window=8,
        rate=4,
        page_size=8,
        positions=[3, 17, 25],
        extend_lens=[1, 1, 1],
        kind="csa",
    )
    torch.testing.assert_close(
        tk.v4_attention_decode(**decode_args(c)), tk.v4_attention_extend(**c), **tol[torch.float32]
    )


def test_decode_bf16(device, tol):
    c = make_case(
        device,
        torch.bfloat16,
        heads=8,
        hd=64,
        window=16,
        rate=4,
        page_size=16,
        positions=[2, 33, 90],
        extend_lens=[1, 1, 1],
        kind="csa",
        top_k=8,
    )
    want = ref.v4_attention_decode(
        **{k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in decode_args(c).items()}
    )
    got = tk.v4_attention_decode(**decode_args(c))
    torch.testing.assert_close(got.float(), want, **tol[torch.bfloat16])


def test_decode_long_context(device, tol):
    """2k+ tokens: CSA's 500+ visible entries with 64 picks, HCA's 260+ entries all read, split."""
    for kind, rate, top_k in (("csa", 4, 64), ("hca", 8, 0)):
        c = make_case(
            device,
            torch.float32,
            heads=4,
            hd=64,
            window=32,
            rate=rate,
            page_size=64,
            positions=[2100, 2500],
            extend_lens=[1, 1],
            kind=kind,
            top_k=top_k,
        )
        want = ref.v4_attention_decode(**decode_args(c))
        got = tk.v4_attention_decode(**decode_args(c), num_splits=4)
        torch.testing.assert_close(got, want, **tol[torch.float32])


@pytest.mark.slow
def test_v4_flash_shapes(device, tol):
    """V4-Flash: 64 heads of 512, window 128, CSA top-512 at 2k+ context; decode and a chunk."""
    c = make_case(
        device,
        torch.float32,
        heads=64,
        hd=512,
        window=128,
        rate=4,
        page_size=64,
        positions=[2200, 2600],
        extend_lens=[1, 1],
        kind="csa",
        top_k=512,
    )
    torch.testing.assert_close(
        tk.v4_attention_decode(**decode_args(c), num_splits=2),
        ref.v4_attention_decode(**decode_args(c)),
        **tol[torch.float32],
    )
    c = make_case(
        device,
        torch.float32,
        heads=64,
        hd=512,
        window=128,
        rate=128,
        page_size=64,
        positions=list(range(2040, 2050)),
        extend_lens=[10],
        kind="hca",
    )
    torch.testing.assert_close(tk.v4_attention_extend(**c), ref.v4_attention_extend(**c), **tol[torch.float32])


def test_decode_tiles_and_splits_fill_the_gpu_without_needless_partials(monkeypatch):
    """On an H200-sized GPU (132 SMs): batch 64 at V4-Flash's 64 heads takes 32-head tiles and
    no key split (partials would cost HBM traffic); batch 1 takes 16-head tiles and splits its
    key list; fp32 keeps its tiles."""
    monkeypatch.setattr(tk, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    cfg = tk.decode_config(512, 64, 90, 2, 64, 132)
    assert cfg.block_h == 32
    assert tk.default_num_splits(64, 2, 640, cfg, cuda) == 1
    small = tk.decode_config(512, 64, 90, 2, 1, 132)
    assert small.block_h == 16
    assert tk.default_num_splits(1, 4, 640, small, cuda) == 10
    assert tk.decode_config(512, 64, 90, 2, 256, 132).block_h == 64
    assert tk.decode_config(512, 64, 90, 4, 1, 132) == tk.attn_config(512, 64, 90, 4)
