"""The native CPU MLA decode (dsv4_kernels.cpu_mla) against the torch form (reference.mla_decode)
and an fp64 oracle over random paged pools; then the engine's greedy tokens with it on and off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dsv4_kernels import cpu_mla
from dsv4_kernels import reference as R

pytestmark = pytest.mark.skipif(not cpu_mla.available(), reason="no C compiler on this machine")

EPS32 = torch.finfo(torch.float32).eps


def _case(
    page_size: int, heads: int, lens: list[int], D: int = 576, layers: int = 3, seed: int = 0, dtype=torch.float32
):
    """A layer's strided view of a page-major pool, each request's pages at random, entries past a
    request's last page set to -1 (the table's padding), q [B, H, D]."""
    g = torch.Generator().manual_seed(seed)
    width = max(1, max(-(-n // page_size) for n in lens)) + 1
    num_pages = len(lens) * width + 3
    pool = torch.randn(num_pages, layers, page_size, D, generator=g).to(dtype)
    kv = pool[:, 1]  # stride(0) = layers * page_size * D
    table = torch.full((len(lens), width), -1, dtype=torch.int32)
    perm = torch.randperm(num_pages, generator=g)
    for b, n in enumerate(lens):
        used = -(-n // page_size)
        table[b, :used] = perm[b * width : b * width + used].int()
    q = (torch.randn(len(lens), heads, D, generator=g) * 2).to(dtype)
    return q, kv, table, torch.tensor(lens, dtype=torch.int32)


def _fp64_oracle(q, kv, table, lens, scale, v_dim):
    out = torch.zeros(q.shape[0], q.shape[1], v_dim, dtype=torch.float64)
    ps = kv.shape[1]
    for b, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        rows = kv[table[b, : -(-n // ps)].long()].reshape(-1, kv.shape[2])[:n].double()
        p = torch.softmax(q[b].double() * scale @ rows.T, dim=-1)
        out[b] = p @ rows[:, :v_dim]
    return out


@pytest.mark.parametrize(
    "page_size,heads,lens",
    [
        (1, 1, [1, 2, 7]),
        (16, 8, [1, 15, 16, 17, 32, 33, 150]),
        (16, 3, [0, 16, 1]),  # seq_len 0: batch padding, zeros
        (64, 16, [1, 63, 64, 65, 200]),
        (64, 5, [129]),
        # row counts off the three-row score passes and the 16-lane exp, a whole block, heads
        # in a group of eight and one of four
        (16, 12, [2, 3, 4, 48, 64, 95, 191]),
    ],
)
def test_native_matches_torch_and_fp64(page_size, heads, lens):
    q, kv, table, seq_lens = _case(page_size, heads, lens, seed=page_size + heads)
    scale, v_dim = 0.07, 512
    got = cpu_mla.mla_decode(q, kv, table, seq_lens, scale, v_dim)
    torch_form = R.mla_decode(q, kv, table, seq_lens, scale, v_dim)
    exact = _fp64_oracle(q, kv, table, seq_lens, scale, v_dim)
    # Both are fp32 sums of the same products in different orders: dot products of 576 terms and
    # value sums of n terms, each off by ~sqrt(terms) ulps of its magnitude, so the outputs (convex
    # combinations of N(0, 1) rows) differ by ~1e-6; 2e-5 leaves room. A dropped, repeated or
    # misplaced row moves an output by ~p * |v| >= 1e-3 here, far outside it.
    torch.testing.assert_close(got, torch_form, rtol=0, atol=2e-5)
    # ... and the native order is no less accurate than torch's own against fp64
    err_native = (got.double() - exact).abs().max().item()
    err_torch = (torch_form.double() - exact).abs().max().item()
    assert err_native <= 4 * err_torch + 8 * EPS32, (err_native, err_torch)
    for b, n in enumerate(lens):
        if n == 0:
            assert got[b].abs().max() == 0


@pytest.mark.parametrize("seed", [11, 12])
def test_sharp_softmax(seed):
    """Scores spread over [-240, 240], exact in fp32 (q one-hot at column 0 with the head's
    number, column 0 of the rows small integers): most exps far below the max's, many under the
    vector exp's flush to zero (exp < 2^-125), and the exps' own accuracy is what is checked."""
    q, kv, table, seq_lens = _case(16, 8, [5, 70, 150], seed=seed)
    q.zero_()
    q[:, :, 0] = torch.arange(1, 9).float()
    kv[..., 0] = torch.randint(-40, 41, kv.shape[:2], generator=torch.Generator().manual_seed(seed)).float()
    got = cpu_mla.mla_decode(q, kv, table, seq_lens, 0.75, 512)
    torch_form = R.mla_decode(q, kv, table, seq_lens, 0.75, 512)
    torch.testing.assert_close(got, torch_form, rtol=0, atol=2e-5)
    exact = _fp64_oracle(q, kv, table, seq_lens, 0.75, 512)
    err_native = (got.double() - exact).abs().max().item()
    err_torch = (torch_form.double() - exact).abs().max().item()
    assert err_native <= 4 * err_torch + 8 * EPS32, (err_native, err_torch)


@pytest.mark.parametrize("D,v_dim", [(80, 64), (19, 16), (576, 576)])
def test_widths_off_the_vector_lanes(D, v_dim):
    """Widths that are not multiples of the 16-lane partial sums, and value = the whole row."""
    q, kv, table, seq_lens = _case(16, 4, [1, 17, 40], D=D, seed=D)
    got = cpu_mla.mla_decode(q, kv, table, seq_lens, 0.2, v_dim)
    torch.testing.assert_close(got, R.mla_decode(q, kv, table, seq_lens, 0.2, v_dim), rtol=0, atol=2e-5)


def test_bf16_pool_matches_torch_to_bf16_rounding():
    q, kv, table, seq_lens = _case(16, 8, [1, 16, 77], seed=3, dtype=torch.bfloat16)
    got = cpu_mla.mla_decode(q, kv, table, seq_lens, 0.07, 512)
    want = R.mla_decode(q, kv, table, seq_lens, 0.07, 512)
    assert got.dtype == torch.bfloat16
    # both widen the same bf16 values and compute in fp32; the outputs (|v| < ~4) are rounded to
    # bf16 (8 bits): a one-ulp difference in rounding is up to 2**-6 at that magnitude
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2**-6)


def test_a_live_token_on_a_page_outside_the_pool_raises():
    q, kv, table, seq_lens = _case(16, 2, [20], seed=1)
    table[0, 1] = kv.shape[0]
    with pytest.raises(IndexError):
        cpu_mla.mla_decode(q, kv, table, seq_lens, 0.1, 512)


def test_a_seq_len_past_the_tables_width_raises():
    q, kv, table, seq_lens = _case(16, 2, [20], seed=1)
    with pytest.raises(IndexError):
        cpu_mla.mla_decode(q, kv, table[:, :1], seq_lens, 0.1, 512)  # 20 tokens need 2 pages


def test_supports_cpu_fp32_and_bf16_pools_only():
    q, kv, _, _ = _case(16, 2, [3])
    assert cpu_mla.supports(q, kv)
    assert cpu_mla.supports(q.bfloat16(), kv.bfloat16())
    assert not cpu_mla.supports(q.half(), kv.half())
    assert not cpu_mla.supports(q, kv[:, :, :100])  # rows not contiguous runs of a page


def _greedy(model_dir, native: bool, monkeypatch) -> list[list[int]]:
    from dsv4_engine.engine import Engine
    from dsv4_engine.engine_args import EngineArgs
    from dsv4_engine.sampling_params import SamplingParams
    from dsv4_engine.sequence import Sequence

    engine = Engine(EngineArgs(model=str(model_dir), device="cpu", kernel_backend="cpu", dtype="float32", kv_pages=64))
    ops = engine.runner.local_model.ops
    assert ops.implementations()["mla_decode"] == "cpu: native"  # the CPU backend picks the native decode
    if not native:  # the backend's decode op in its torch form
        from dsv4_kernels.ops_torch import TorchOps

        ops.mla_decode = TorchOps.mla_decode
    calls = []
    kernel = cpu_mla.mla_decode
    monkeypatch.setattr(cpu_mla, "mla_decode", lambda *a: calls.append(1) or kernel(*a))
    g = torch.Generator().manual_seed(5)
    seqs = [
        Sequence(
            f"r{i}",
            torch.randint(2, engine.cfg.vocab_size, (n,), generator=g).tolist(),
            SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        )
        for i, n in enumerate([1, 15, 16, 17, 40])
    ]
    for s in seqs:
        engine._add(s)
    while engine.scheduler.has_work():
        engine.step()
    assert bool(calls) == native  # the decode steps ran the native kernel exactly when it was on
    return [s.output_ids for s in seqs]


@pytest.mark.parametrize("preset", ["tiny", "mla512"])
def test_engine_greedy_tokens_unchanged_by_the_native_decode(preset, make_model, monkeypatch):
    model_dir = make_model(preset)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the serving engine core runs; 2 threads on a loaded 2-core box crawl
    try:
        assert _greedy(model_dir, True, monkeypatch) == _greedy(model_dir, False, monkeypatch)
    finally:
        torch.set_num_threads(threads)


def test_the_kernels_own_switch_keeps_the_torch_form():
    """DSV4_NO_NATIVE_MLA=1 (a fresh process: the library is loaded once per process)."""
    code = "from dsv4_kernels import cpu_mla; print(cpu_mla.available())"
    env = {**os.environ, "DSV4_NO_NATIVE_MLA": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
