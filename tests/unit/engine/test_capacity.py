"""The capacity model (dsv4_engine.capacity) against itself (layouts, KV dtypes) and against what
a running engine sizes its pool to for the same memory (v4-tiny here; V4-Flash's real widths in
the slow test)."""

from __future__ import annotations

import pytest
import torch

from dsv4_engine.capacity import capacity, kv_cost, pool_tokens
from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.models import entry_for_dir

GB = 1e9


def model_cost(model_dir, kv_cache_dtype: str, dtype=torch.float32):
    entry = entry_for_dir(model_dir)
    specs = entry.model_class().state_specs(entry.config_class().from_dir(model_dir))
    return kv_cost(specs, dtype, kv_cache_dtype)


def test_dp_attention_holds_a_pool_per_gpu_and_fp8_about_twice_the_tokens(make_model):
    bf16 = model_cost(make_model("v4-tiny"), "auto", torch.bfloat16)
    fp8 = model_cost(make_model("v4-tiny"), "fp8_e4m3", torch.bfloat16)
    tp = capacity(bf16, "auto", 96 * GB, 10 * GB, 160 * GB, 8, "tp", 6 * GB, context=4096)
    dp = capacity(bf16, "auto", 96 * GB, 10 * GB, 160 * GB, 8, "dp", 6 * GB, context=4096)
    assert tp.weights_per_gpu == dp.weights_per_gpu == 30 * GB and tp.kv_bytes_per_gpu == 60 * GB
    assert dp.kv_tokens_box == 8 * tp.kv_tokens_box and dp.agents == 8 * tp.agents > 0
    assert 1.8 < fp8.page_size / fp8.page_bytes * bf16.page_bytes / bf16.page_size < 2.0
    with pytest.raises(ValueError, match="layout"):
        capacity(bf16, "auto", 96 * GB, 0, 0, 8, "ep", 0)


@pytest.mark.parametrize(
    "preset,gib",
    [("v4-tiny", 0.02), pytest.param("v4-flash-shape", 0.5, marks=pytest.mark.slow)],  # flash: 765 MB of weights
)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_the_engine_sizes_its_pool_as_the_model_says(make_model, kv_cache_dtype, preset, gib):
    model = make_model(preset)
    engine = Engine(
        EngineArgs(
            model=str(model),
            device="cpu",
            kernel_backend="cpu",
            kv_memory_gb=gib,
            kv_cache_dtype=kv_cache_dtype,
            max_num_seqs=4,
            enable_prefix_cache=False,
        )
    )
    loads = engine.loads()
    engine_tokens = loads["kv_pages_total"] * engine.pool.page_size
    assert engine_tokens == pool_tokens(model_cost(model, kv_cache_dtype), int(gib * (1 << 30)), max_num_seqs=4)
    assert loads["kv_sizing"]["kv_cache_dtype"] == kv_cache_dtype
