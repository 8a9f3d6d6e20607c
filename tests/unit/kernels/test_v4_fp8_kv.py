"""DeepSeek-V4's Triton attention and indexer over an FP8 KV cache (`--kv-cache-dtype fp8_e4m3`):
the ring, the compressed entries and the indexer keys are packed rows (e4m3 values, then a
float32 scale; dsv4_engine.kv_quant), converted in the kernels' tile loops, against the torch
references reading the same packed rows; the chunk's own keys stay in q's dtype."""

from __future__ import annotations

import pytest
import torch
from test_v4_attention import decode_args, make_case
from test_v4_indexer import assert_same_picks
from test_v4_indexer import make_case as make_indexer_case

from dsv4_engine import kv_quant
from dsv4_kernels import reference_v4 as ref
from dsv4_kernels.triton_kernels import v4_attention as tk
from dsv4_kernels.triton_kernels import v4_indexer as tki


def packed(c: dict) -> dict:
    """The case with its ring and entries stored as packed FP8 rows (as the engine's pool)."""
    out = dict(c)
    out["ring"] = kv_quant.quantize(c["ring"])
    if c["comp_kv"] is not None:
        out["comp_kv"] = kv_quant.quantize(c["comp_kv"])
    return out


def attention_case(device, dtype, kind, *, heads=4, hd=64, lens=(1, 1, 1), starts=(5, 9, 37)):
    positions = [s + i for s, n in zip(starts, lens) for i in range(n)]
    rate = {"swa": 1, "csa": 4, "hca": 8}[kind]
    return make_case(
        device, dtype, heads=heads, hd=hd, window=8, rate=rate, page_size=16,
        positions=positions, extend_lens=list(lens), kind=kind,
    )  # fmt: skip


def test_decode_reads_fp8_ring_and_csa_entries(device, tol):
    """Split over two programs: both halves (window, then picks) read packed rows."""
    c = packed(attention_case(device, torch.float32, "csa"))
    assert c["ring"].dtype == torch.uint8 and c["comp_kv"].shape[-1] == 64 + 4
    want = ref.v4_attention_decode(**decode_args(c))
    got = tk.v4_attention_decode(**decode_args(c), num_splits=2)
    torch.testing.assert_close(got, want, **tol[torch.float32])


def test_extend_mixes_fp8_ring_rows_with_the_chunks_own_keys(device, tol):
    """Chunks starting mid-window: a tile holds ring rows (packed) and own rows (q's dtype)."""
    c = packed(attention_case(device, torch.float32, "hca", lens=(3, 1), starts=(6, 20)))
    want = ref.v4_attention_extend(**c)
    torch.testing.assert_close(tk.v4_attention_extend(**c), want, **tol[torch.float32])


def test_fp8_rows_of_the_wrong_width_or_a_plain_ring_with_packed_entries_are_refused(device):
    c = packed(attention_case(device, torch.float32, "csa"))
    with pytest.raises(ValueError, match="FP8 comp_kv rows"):
        tk.v4_attention_decode(**{**decode_args(c), "comp_kv": c["comp_kv"][..., :-4]})
    plain_ring = attention_case(device, torch.float32, "csa")["ring"]
    with pytest.raises(ValueError, match="comp_kv is torch.uint8"):
        tk.v4_attention_decode(**{**decode_args(c), "ring": plain_ring})


def test_indexer_reads_fp8_keys(device):
    lens, starts = [1, 5], [30, 40]
    positions = [s + i for s, n in zip(starts, lens) for i in range(n)]
    c = make_indexer_case(
        device, torch.float32, heads=8, dim=32, rate=4, page_size=16, positions=positions, extend_lens=lens, top_k=4
    )
    c["index_k"] = kv_quant.quantize(c["index_k"])
    want = ref.v4_indexer_topk(**c)
    assert_same_picks(
        tki.v4_indexer_topk(**c), want, {**c, "index_k": kv_quant.dequantize(c["index_k"], torch.float32)}
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["swa", "csa", "hca"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_attention_at_wide_heads_and_long_contexts(device, tol, kind, dtype):
    """20 heads (two tiles), head_dim 512 with the scale's 4 bytes past the row's 512, chunks
    at 0, mid-window and past it, decode split in three."""
    lens, starts = (12, 5, 1, 9), (0, 6, 300, 250)
    c = packed(attention_case(device, dtype, kind, heads=20, hd=512, lens=lens, starts=starts))
    torch.testing.assert_close(tk.v4_attention_extend(**c).float(), ref.v4_attention_extend(**c).float(), **tol[dtype])
    d = packed(attention_case(device, dtype, kind, heads=20, hd=512, lens=(1, 1, 1), starts=(7, 300, 611)))
    got = tk.v4_attention_decode(**decode_args(d), num_splits=3)
    torch.testing.assert_close(got.float(), ref.v4_attention_decode(**decode_args(d)).float(), **tol[dtype])


@pytest.mark.slow
def test_fp8_indexer_long_context(device):
    c = make_indexer_case(
        device, torch.float32, heads=8, dim=128, rate=4, page_size=64,
        positions=[2100, 2600, 2601], extend_lens=[1, 2], top_k=64,
    )  # fmt: skip
    c["index_k"] = kv_quant.quantize(c["index_k"])
    want = ref.v4_indexer_topk(**c)
    assert_same_picks(
        tki.v4_indexer_topk(**c), want, {**c, "index_k": kv_quant.dequantize(c["index_k"], torch.float32)}
    )
