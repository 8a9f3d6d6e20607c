"""FP8 KV storage (dsv4_engine.kv_quant): the format's error bound, what the pool allocates and
what sizing counts, and the PD layout check naming the flag when peers differ."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dsv4_engine import kv_quant
from dsv4_engine.kv_cache import KVPool, page_nbytes
from dsv4_engine.kv_sizing import KVBudget, size_pool
from dsv4_engine.models.deepseek_v3 import DeepseekV3
from dsv4_engine.models.state import StateSpec
from dsv4_engine.pd.transport import layout_mismatch, regions_of


def test_round_trip_error_is_within_e4m3_precision_per_entry():
    g = torch.Generator().manual_seed(0)
    # entries of very different magnitudes: a scale per entry keeps each one's relative error
    x = torch.randn(64, 576, generator=g) * torch.logspace(-3, 3, 64)[:, None]
    packed = kv_quant.quantize(x)
    assert packed.dtype == torch.uint8 and packed.shape == (64, 580)
    back = kv_quant.dequantize(packed, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    # e4m3: 3 mantissa bits (half-ulp 2^-4 relative) down to 2^-6 of the range, then subnormal steps of 2^-9
    bound = torch.maximum(x.abs() * 2.0**-4, amax / 448 * 2.0**-10)
    assert ((back - x).abs() <= bound * 1.0001).all()
    assert torch.equal(kv_quant.dequantize(kv_quant.quantize(torch.zeros(3, 8)), torch.float32), torch.zeros(3, 8))


def test_store_and_decode_are_plain_casts_on_an_unpacked_state():
    store = torch.zeros(4, 8, dtype=torch.bfloat16)
    kv_quant.store_(store, torch.tensor([1, 3]), torch.ones(2, 8))
    assert store.dtype == torch.bfloat16 and store[1].eq(1).all() and store[0].eq(0).all()
    assert kv_quant.decode(store, torch.float32).dtype == torch.float32


def test_unknown_kv_cache_dtype_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="fp8_e4m3"):
        kv_quant.canonical("fp8_e5m2")
    assert kv_quant.canonical("fp8") == kv_quant.FP8_E4M3 and kv_quant.canonical(None) == kv_quant.AUTO


def v3_specs(kv_dtype: str):
    # DeepSeek-V3's own declaration: 61 layers of a 512 + 64 latent
    cfg = SimpleNamespace(num_hidden_layers=61, kv_cache_dim=576)
    return kv_quant.with_kv_cache_dtype(DeepseekV3.state_specs(cfg), kv_dtype)


def test_v3_latent_costs_about_half_of_bf16_and_the_pool_holds_twice_the_pages():
    bf16 = page_nbytes(v3_specs("auto"), 64, torch.bfloat16) / 64
    fp8 = page_nbytes(v3_specs("fp8_e4m3"), 64, torch.bfloat16) / 64
    assert bf16 == 61 * 576 * 2 and fp8 == 61 * 580  # 70,272 vs 35,380 bytes a token: 0.503x
    budget = KVBudget(8 << 30, "test")
    pages = {k: size_pool(v3_specs(k), 64, torch.bfloat16, budget, 8, None).num_pages for k in ("auto", "fp8")}
    assert 1.95 < pages["fp8"] / pages["auto"] < 2.0


def test_pool_stores_only_quantizable_states_packed():
    specs = kv_quant.with_kv_cache_dtype(
        [
            StateSpec("kv", 2, (16,), quantizable=True),
            StateSpec("ring", 2, (16,), kind="slot", slots=4, quantizable=True),
            StateSpec("stage", 2, (32,), kind="slot", slots=4),  # a compressor's running sums stay in the model dtype
        ],
        "fp8_e4m3",
    )
    pool = KVPool(specs, 8, 4, torch.float32, torch.device("cpu"), max_num_seqs=2)
    got = {n: (t.dtype, t.shape[-1]) for n, t in pool.all_states.items()}
    assert got == {"kv": (torch.uint8, 20), "ring": (torch.uint8, 20), "stage": (torch.float32, 32)}
    assert pool.bytes_per_token() == {"kv": 2 * 20}


def test_a_peer_with_another_kv_dtype_is_refused_naming_the_flag():
    specs = [StateSpec("latent_kv", 2, (16,), quantizable=True)]
    pools = {
        k: KVPool(kv_quant.with_kv_cache_dtype(specs, k), 4, 4, torch.bfloat16, torch.device("cpu"))
        for k in ("auto", "fp8_e4m3")
    }
    why = layout_mismatch(regions_of(pools["fp8_e4m3"].states), regions_of(pools["auto"].states))
    assert why is not None and "fp8_e4m3 != bfloat16" in why and "--kv-cache-dtype" in why
    assert layout_mismatch(regions_of(pools["fp8_e4m3"].states), regions_of(pools["fp8_e4m3"].states)) is None
