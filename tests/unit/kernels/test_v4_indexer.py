"""Lightning indexer top-k against the torch reference: the same entries in the same order
(score, then lower entry on ties), read in place from shuffled pages, for decode tokens and
prefill chunks, up to 2k+ tokens of context."""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels import reference_v4 as ref
from dsv4_kernels.triton_kernels import v4_indexer as tk


def make_case(device, dtype, *, heads, dim, rate, page_size, positions, extend_lens, top_k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.tensor(positions, dtype=torch.int64)
    lens = torch.tensor(extend_lens, dtype=torch.int64)
    T, B = int(lens.sum()), len(extend_lens)
    ends = [int(positions[int(lens[: b + 1].sum()) - 1]) + 1 for b in range(B)]
    pages_needed = [-(-e // page_size) for e in ends]
    epp = max(1, page_size // rate)
    num_pages = sum(pages_needed) + 2
    store = torch.randn(num_pages, 3, epp, dim, generator=gen)[:, 2]
    order = torch.randperm(num_pages, generator=gen)
    table = torch.full((B, max(pages_needed) + 2), num_pages + 77, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_needed):
        table[b, :n] = order[used : used + n].to(torch.int32)
        used += n
    iq = torch.randn(T, heads, dim, generator=gen)
    iw = torch.randn(T, heads, generator=gen) * heads**-0.5
    return dict(
        iq=iq.to(dtype).to(device),
        iw=iw.to(device),
        index_k=store.to(dtype).to(device),
        block_table=table.to(device),
        positions=positions.to(device),
        extend_lens=lens.to(device),
        top_k=top_k,
        scale=dim**-0.5,
        rate=rate,
        page_size=page_size,
    )


def exact_scores(c: dict, b: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Query t's (of request b) scores of every visible entry in float64, and how far a float32
    side may be from each: a score is a sum over heads of relu(q . k) dot products, within
    (d + heads) * 2**-24 of exact relative to the sum of its terms' magnitudes."""
    iq, iw, store = c["iq"].double().cpu(), c["iw"].double().cpu(), c["index_k"].double().cpu()
    heads, d = iq.shape[1], iq.shape[2]
    w = torch.arange((int(c["positions"][t]) + 1) // c["rate"])
    keys = ref._entry_rows(store, c["block_table"][b].cpu(), w, c["rate"], c["page_size"])  # [C, d]
    score = (torch.relu(iq[t] @ keys.t()) * c["scale"] * iw[t][:, None]).sum(0)
    mag = ((iq[t].abs() @ keys.abs().t()) * c["scale"] * iw[t].abs()[:, None]).sum(0)
    return score, (d + heads) * 2.0**-24 * mag


def assert_same_picks(got: torch.Tensor, want: torch.Tensor, c: dict) -> None:
    """`got` picks the entries `want` picks, in its order, except where two entries' scores are
    closer than the two float32 sides can tell apart (each computes its sums in its own order)."""
    got, want = got.cpu(), want.cpu()
    if torch.equal(got, want):
        return
    row = 0
    for b, n in enumerate(c["extend_lens"].tolist()):
        for t in range(row, row + n):
            g, h = got[t], want[t]
            assert torch.equal(g == -1, h == -1), (t, g, h)
            assert len(set(g.tolist())) == len(g)
            score, bound = exact_scores(c, b, t)
            for i in range(len(g)):
                if g[i] != h[i]:  # a swap only between scores float32 cannot order
                    gap = abs(float(score[g[i]] - score[h[i]]))
                    assert gap <= 2 * float(bound[g[i]] + bound[h[i]]), (t, i, int(g[i]), int(h[i]), gap)
        row += n


def test_decode_and_chunks_pick_the_reference_entries(device):
    lens = [1, 1, 14, 6, 1]
    starts = [2, 30, 0, 40, 71]
    positions = [s + i for s, n in zip(starts, lens) for i in range(n)]
    c = make_case(
        device, torch.float32, heads=8, dim=32, rate=4, page_size=16, positions=positions, extend_lens=lens, top_k=4
    )
    want = ref.v4_indexer_topk(**c)
    got = tk.v4_indexer_topk(**c)
    assert_same_picks(got, want, c)
    # fewer visible entries than top_k: the rest is -1; none visible: all -1
    assert (want[0] == -1).all() and (want[2, :] == -1).all()


def test_ties_go_to_the_lower_entry(device):
    """Zero head weights make every score 0: both backends keep the first top_k entries."""
    c = make_case(
        device, torch.float32, heads=8, dim=32, rate=4, page_size=16, positions=[63, 90], extend_lens=[1, 1], top_k=8
    )
    c["iw"] = torch.zeros_like(c["iw"])
    got = tk.v4_indexer_topk(**c)
    assert torch.equal(got.cpu(), ref.v4_indexer_topk(**c).cpu())
    assert got[0].tolist() == list(range(8))


def test_long_context_running_top_k(device):
    """2k+ tokens of context (500+ entries in 64-entry tiles) into a top-64 buffer."""
    c = make_case(
        device,
        torch.float32,
        heads=8,
        dim=32,
        rate=4,
        page_size=64,
        positions=[2100, 2600, 2601],
        extend_lens=[1, 2],
        top_k=64,
    )
    assert_same_picks(tk.v4_indexer_topk(**c), ref.v4_indexer_topk(**c), c)


def test_bf16_picks_nearly_the_same_entries(device):
    c = make_case(
        device,
        torch.bfloat16,
        heads=16,
        dim=64,
        rate=4,
        page_size=16,
        positions=[200, 333],
        extend_lens=[1, 1],
        top_k=16,
    )
    want = ref.v4_indexer_topk(**c)
    got = tk.v4_indexer_topk(**c)
    for g, w in zip(got.cpu(), want.cpu()):
        assert len(set(g.tolist()) & set(w.tolist())) >= 14  # bf16 sums may reorder near-ties


@pytest.mark.slow
def test_v4_flash_shapes(device):
    """V4-Flash's indexer: 64 heads of 128, top-512 of 525 entries (~2 min under the interpreter)."""
    c = make_case(
        device, torch.float32, heads=64, dim=128, rate=4, page_size=64, positions=[2100], extend_lens=[1], top_k=512
    )
    assert_same_picks(tk.v4_indexer_topk(**c), ref.v4_indexer_topk(**c), c)


def test_the_tie_check_refuses_a_real_swap():
    """assert_same_picks lets only float32-indistinguishable scores swap: two picks far apart may not."""
    c = make_case("cpu", torch.float32, heads=8, dim=32, rate=4, page_size=16, positions=[90], extend_lens=[1], top_k=4)
    want = ref.v4_indexer_topk(**c)
    swapped = want.clone()
    swapped[0, 0], swapped[0, 3] = want[0, 3], want[0, 0]
    with pytest.raises(AssertionError):
        assert_same_picks(swapped, want, c)
    score, bound = exact_scores(c, 0, 0)
    picked = score[want[0].long()]
    assert (picked[:-1] >= picked[1:]).all()  # the float64 scores order the reference's picks
    assert (score.sort(descending=True).values[:4] - picked).abs().max() <= 2 * bound.max()


def test_split_scan_and_merge_pick_the_reference_entries(device):
    """Key tiles interleaved across programs (a short query leaves some splits empty), then
    merged: the same picks as the reference, and exactly the serial scan's (ties included)."""
    lens = [1, 2, 1]
    positions = [170, 61, 62, 2]
    c = make_case(
        device, torch.float32, heads=8, dim=32, rate=4, page_size=16, positions=positions, extend_lens=lens, top_k=8
    )
    got = tk.v4_indexer_topk(**c, num_splits=3)
    assert_same_picks(got, ref.v4_indexer_topk(**c), c)
    assert torch.equal(got, tk.v4_indexer_topk(**c, num_splits=1))
    assert (got[3] == -1).all()  # no visible entry


def test_split_merge_breaks_ties_toward_the_lower_entry(device):
    """Equal scores in every split: the merge keeps the first top_k entries, as the reference."""
    c = make_case(
        device, torch.float32, heads=8, dim=32, rate=4, page_size=16, positions=[127], extend_lens=[1], top_k=8
    )
    c["iw"] = torch.zeros_like(c["iw"])
    got = tk.v4_indexer_topk(**c, num_splits=4)
    assert torch.equal(got.cpu(), ref.v4_indexer_topk(**c).cpu())
    assert got[0].tolist() == list(range(8))


def test_indexer_splits_fill_the_device_from_shapes():
    # decode at batch 1 on 132 SMs: 32 programs over the key tiles (capped by MAX_SPLITS)
    assert tk.indexer_splits(1, 131072, 64, 132) == tk.MAX_SPLITS
    # batch 32: 2 waves of 132 SMs need ~9 a query
    assert tk.indexer_splits(32, 131072, 64, 132) == 9
    # enough queries to fill the device: the serial scan
    assert tk.indexer_splits(512, 131072, 64, 132) == 1
    # never more splits than tiles
    assert tk.indexer_splits(1, 100, 64, 132) == 2
