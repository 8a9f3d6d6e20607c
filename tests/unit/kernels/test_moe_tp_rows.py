"""Tensor-parallel experts write only their rows: the pairs routed to another rank's experts
(id -1, about 7/8 of them at TP 8) are neither computed, nor written as zero rows, nor read by
the sum. Each down GEMM (bf16/fp32, fp8, fp4) is run on an output prefilled with NaN: other
ranks' rows must still hold NaN afterwards, and the sum over a token's pairs must not see them."""

from __future__ import annotations

import torch

from dsv4_kernels import reference, reference_quant
from dsv4_kernels.triton_kernels import fp4_gemm, fp8_gemm, moe_experts

T, TOP_K, E, H, INTER = 6, 3, 4, 32, 32


def tp_ids(seed: int = 0) -> torch.Tensor:
    """Rank 0 of 2 (global experts 0-7, this rank holds 0-3): other ranks' picks become -1."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(2 * E, generator=gen)[:TOP_K] for _ in range(T)])
    ids[0] = torch.tensor([5, 6, 7])  # a token with no local pair: its output is zero (or `add`)
    return torch.where(ids < E, ids, torch.full_like(ids, -1))


def nan_rows(ids: torch.Tensor, width: int) -> torch.Tensor:
    return torch.full((ids.numel(), width), float("nan"))


def assert_only_local_rows_written(y: torch.Tensor, ids: torch.Tensor) -> None:
    local = ids.reshape(-1).cpu() >= 0
    assert torch.isfinite(y.cpu()[local]).all()
    assert torch.isnan(y.cpu()[~local]).all(), "a down GEMM wrote rows of another rank's pairs"


def test_sum_reads_only_local_rows(device):
    ids = tp_ids()
    y = torch.randn(T * TOP_K, H)
    y[ids.reshape(-1) < 0] = float("nan")  # never written: may hold anything
    add = torch.randn(T, H)
    local = (ids >= 0).unsqueeze(-1)
    want = torch.where(local, y.view(T, TOP_K, H), 0.0).sum(1)
    got = moe_experts.sum_local_rows(y.to(device), ids.to(device), torch.float32, add.to(device))
    torch.testing.assert_close(got.cpu(), want + add, atol=1e-6, rtol=1e-6)
    assert torch.equal(got.cpu()[0], add[0])


def test_bf16_fp32_experts_write_only_local_rows(device):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=gen)
    w13 = torch.randn(E, 2 * INTER, H, generator=gen) * H**-0.5
    w2 = torch.randn(E, H, INTER, generator=gen) * INTER**-0.5
    weights = torch.rand(T, TOP_K, generator=gen)
    ids = tp_ids(1)
    dev = lambda t: t.to(device)  # noqa: E731
    got = moe_experts.moe_experts(dev(x), dev(w13), dev(w2), dev(weights), dev(ids))
    want = reference.moe_experts(x, w13, w2, weights * (ids >= 0), ids.clamp(min=0))
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
    # the down GEMM alone, on a NaN-filled output
    cfg = moe_experts.experts_config(ids.numel(), E, 4)
    pairs, block_expert = moe_experts.align_pairs_by_expert(dev(ids), E, cfg.block_m)
    inter = dev(torch.randn(ids.numel(), INTER, generator=gen))
    y = dev(nan_rows(ids, H))
    moe_experts.down_rows(inter, dev(w2), dev(weights.reshape(-1)), y, pairs, block_expert, cfg)
    assert_only_local_rows_written(y, ids)


def fp4_weights(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (E, n, k // 2), generator=g, dtype=torch.int64).to(torch.uint8)
    exps = torch.randint(120, 123, (E, n, k // 32), generator=g, dtype=torch.int64).to(torch.uint8)
    return codes, exps


def test_fp4_experts_write_only_local_rows(device):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(T, H, generator=gen)
    (w13, s13), (w2, s2) = fp4_weights(2 * INTER, H, 3), fp4_weights(H, INTER, 4)
    weights = torch.rand(T, TOP_K, generator=gen)
    ids = tp_ids(2)
    dev = lambda t: t.to(device)  # noqa: E731
    args = [dev(t) for t in (x, w13, s13, w2, s2, weights, ids)]
    got = fp4_gemm.fp4_moe_experts(*args, 7.0)
    want = reference_quant.fp4_moe_experts(x, w13, s13, w2, s2, weights, ids, 7.0)
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
    tiles = fp4_gemm.fp4_blocks(ids.numel() // E, elem_size=4)
    pairs, block_expert = moe_experts.align_pairs_by_expert(dev(ids), E, tiles[0])
    inter, y = dev(torch.randn(ids.numel(), INTER, generator=gen)), dev(nan_rows(ids, H))
    fp4_gemm._launch(
        inter, args[3], args[4], y, dev(weights.reshape(-1)), pairs, block_expert, ids.numel(), H,
        a_div=1, dense=False, gated=False, limit=None, tiles=tiles, num_m_blocks=block_expert.shape[0],
    )  # fmt: skip
    assert_only_local_rows_written(y, ids)


def test_fp8_experts_write_only_local_rows(device):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=gen)
    w13 = (torch.randn(E, 2 * INTER, H, generator=gen) * 0.1).to(torch.float8_e4m3fn)
    w2 = (torch.randn(E, H, INTER, generator=gen) * 0.1).to(torch.float8_e4m3fn)
    s13 = torch.rand(E, 2 * INTER, 1, generator=gen) + 0.5
    s2 = torch.rand(E, H, 1, generator=gen) + 0.5
    weights = torch.rand(T, TOP_K, generator=gen)
    ids = tp_ids(3)
    dev = lambda t: t.to(device)  # noqa: E731
    args = [dev(t) for t in (x, w13, s13, w2, s2, weights, ids)]
    got = fp8_gemm.fp8_moe_experts(*args)
    want = reference_quant.fp8_moe_experts(x, w13, s13, w2, s2, weights, ids)
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
    tiles = fp8_gemm.gemm_blocks(ids.numel() // E)
    pairs, block_expert = moe_experts.align_pairs_by_expert(dev(ids), E, tiles[0])
    iq, is_ = fp8_gemm.fp8_act_quant(dev(torch.randn(ids.numel(), INTER, generator=gen)))
    y = dev(nan_rows(ids, H))
    fp8_gemm._launch(
        iq, is_, args[3], args[4], y, dev(weights.reshape(-1)), pairs, block_expert, ids.numel(), H,
        a_div=1, dense=False, gated=False, limit=None, tiles=tiles, num_m_blocks=block_expert.shape[0],
    )  # fmt: skip
    assert_only_local_rows_written(y, ids)


def test_sum_adds_a_differently_typed_or_strided_add_as_torch_would(device):
    ids = tp_ids(4)
    y = torch.randn(T * TOP_K, H)
    base = moe_experts.sum_local_rows(y.to(device), ids.to(device), torch.float32).cpu()
    wide = torch.randn(H, T).t()  # [T, H] with a non-unit last stride
    got = moe_experts.sum_local_rows(y.to(device), ids.to(device), torch.float32, wide.to(device))
    torch.testing.assert_close(got.cpu(), base + wide, atol=1e-6, rtol=1e-6)
    row = torch.randn(H, dtype=torch.float64)  # broadcast, promoted
    got = moe_experts.sum_local_rows(y.to(device), ids.to(device), torch.float32, row.to(device))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got.cpu(), base + row)
