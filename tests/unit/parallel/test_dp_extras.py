"""Data-parallel attention (`--tp-size 2 --dp-size 2`, rank 1 a real child process, gloo on
127.0.0.1) with the engine's other features on: FP8 KV, EPLB, speculative decoding and (stood in
on the CPU) CUDA graphs. Each equals `--tp-size 1` with the same feature, greedy, with the staggered
arrivals and the abort of test_dp_engine (one rank idles in the first steps)."""

from __future__ import annotations

import pytest
import torch
from test_dp_engine import bounded, one_thread, staggered  # noqa: F401 (fixture)

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs


def engine(model_dir, tp: int, dp: int = 1, kv_pages: int = 10, **kw) -> Engine:
    return Engine(
        EngineArgs(
            model=str(model_dir),
            device="cpu",
            kernel_backend="cpu",
            kv_pages=kv_pages,
            page_size=8,
            max_num_batched_tokens=16,
            tp_size=tp,
            dp_size=dp,
            enable_prefix_cache=False,
            **kw,
        )
    )


def run_dp(model_dir, **kw) -> dict:
    e = engine(model_dir, 2, 2, **kw)
    try:
        return bounded(lambda: staggered(e))
    finally:
        e.tp.close()


def test_dp2_with_fp8_kv_equals_tp1_with_fp8_kv(make_model):
    model = make_model("tiny")
    ref_engine = engine(model, 1, kv_pages=20, kv_cache_dtype="fp8_e4m3")
    assert ref_engine.pool.states["latent_kv"].dtype == torch.uint8  # packed FP8 + scale
    ref = staggered(ref_engine)
    got = run_dp(model, kv_cache_dtype="fp8_e4m3")
    assert got["tokens"] == ref["tokens"] and got["reasons"] == ref["reasons"]
