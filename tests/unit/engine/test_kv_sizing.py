"""KV pool sizing from the device's memory (dsv4_engine.kv_sizing), on DeepSeek-V4-Flash's real
shapes (tests/fixtures/deepseek-v4-flash/config.json: transformers' DeepseekV4Config defaults,
43 layers, 20 CSA + 23 HCA, in the release spelling) with the device's numbers stubbed: the
sizing is arithmetic, no weight is read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dsv4_engine import engine as engine_mod
from dsv4_engine import kv_sizing
from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.kv_cache import default_page_size, page_nbytes, slot_row_nbytes
from dsv4_engine.kv_sizing import (
    GIB,
    SNAPSHOT_SHARE,
    DeviceMemory,
    graph_reserve_bytes,
    kv_budget,
    size_pool,
    tightest,
    weights_refusal,
)
from dsv4_engine.models.deepseek_v4 import DeepseekV4
from dsv4_engine.models.deepseek_v4_config import DeepseekV4Config

FLASH = Path(__file__).resolve().parents[2] / "fixtures" / "deepseek-v4-flash"
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def flash():
    cfg = DeepseekV4Config.from_dir(FLASH)
    assert cfg.num_hidden_layers == 43 and cfg.layer_types.count("compressed_sparse_attention") == 20
    specs = DeepseekV4.state_specs(cfg)
    return cfg, specs, default_page_size(specs)


def test_flash_state_sizes_are_what_the_issue_measured(flash):
    cfg, specs, page = flash
    assert page == 128  # HCA's window
    assert slot_row_nbytes(specs, BF16) / (1 << 20) == pytest.approx(11.9, abs=0.01)
    assert page_nbytes(specs, page, BF16) == 842752  # 6.4 KiB of paged state per token


def test_an_h200_at_tp8_sizes_the_pool_from_the_tightest_rank(flash):
    """Free memory after weights differs per rank (rank 0 also holds the embedding's share...):
    the tightest rank sizes every rank's pool; graphs get their reserve; snapshots at most a
    quarter; the rest is pages."""
    cfg, specs, page = flash
    ranks = [DeviceMemory(free=(120 - r) * GIB, total=141 * GIB) for r in range(8)]
    mem = tightest(ranks)
    assert mem.free == 113 * GIB
    reserve = graph_reserve_bytes(64, cfg.vocab_size)
    assert reserve == 768 * (1 << 20) + 2 * 64 * 129280 * 4
    budget = kv_budget(None, 0.9, mem, reserve)
    assert budget.nbytes == int(113 * GIB * 0.9) - reserve
    size = size_pool(specs, page, BF16, budget, 64, None, default_snapshots=256)
    row, pg = slot_row_nbytes(specs, BF16), page_nbytes(specs, page, BF16)
    assert size.num_snapshots == 256 and not size.snapshots_capped  # 3 GiB: well under a quarter
    assert size.num_pages == (budget.nbytes - (64 + 256) * row) // pg
    assert size.num_pages * page > 1_000_000  # a million tokens of context on one H200 rank
    # An explicit --kv-memory-gb overrides the fraction, graphs or not.
    assert kv_budget(8.0, 0.9, mem, reserve).nbytes == 8 * GIB


def test_snapshots_take_at_most_a_quarter_unless_asked(flash):
    cfg, specs, page = flash
    row = slot_row_nbytes(specs, BF16)
    budget = kv_sizing.KVBudget(2 * GIB, "test")
    capped = size_pool(specs, page, BF16, budget, 8, None, default_snapshots=256)
    assert capped.snapshots_capped and capped.num_snapshots == int(SNAPSHOT_SHARE * 2 * GIB // row) == 43
    asked = size_pool(specs, page, BF16, budget, 8, 100, default_snapshots=256)
    assert asked.num_snapshots == 100 and asked.num_pages < capped.num_pages
    with pytest.raises(ValueError, match="lower --max-num-seqs or --prefix-cache-snapshots"):
        size_pool(specs, page, BF16, budget, 8, 200)


def test_what_cannot_fit_says_what_to_change(flash):
    cfg, specs, page = flash
    with pytest.raises(ValueError, match="no memory left for the KV pool.*raise --tp-size"):
        kv_budget(None, 0.9, DeviceMemory(free=GIB // 2, total=80 * GIB), graph_reserve_bytes(64, cfg.vocab_size))
    with pytest.raises(ValueError, match=r"--max-num-seqs 64 \(11.91 MiB each\)"):
        size_pool(specs, page, BF16, kv_sizing.KVBudget(700 << 20, "x"), 64, 0)
    # Weights: V4-Flash's ~160 GB checkpoint on one 80 GB device cannot fit; at TP 8 it does.
    ckpt = 160 * 10**9
    h100 = DeviceMemory(free=79 * GIB, total=80 * GIB)
    min_kv = 64 * slot_row_nbytes(specs, BF16) + page_nbytes(specs, page, BF16)
    line = weights_refusal(ckpt, h100, 0.9, None, min_kv, 0, 1)
    assert line.startswith("the checkpoint needs at least 149.0 GiB of weights per device at --tp-size 1")
    assert "raise --tp-size" in line
    assert weights_refusal(ckpt // 8, h100, 0.9, None, min_kv, 0, 8) is None
    assert weights_refusal(ckpt, None, 0.9, None, min_kv, 0, 1) is None  # no device numbers: not judged


def test_an_engine_with_no_memory_flags_sizes_its_pool_from_the_device(make_model, monkeypatch):
    """Engine start-up with the device's numbers stubbed (CPU device, CUDA-like report): the pool
    takes --kv-memory-fraction of the free memory, the numbers reach /v1/loads."""
    v4 = make_model("v4-tiny")
    free = 64 << 20
    monkeypatch.setattr(engine_mod, "device_memory", lambda device: DeviceMemory(free, 80 * GIB))
    e = Engine(EngineArgs(model=str(v4), device="cpu", kernel_backend="cpu", max_num_seqs=4, page_size=16))
    specs, dt = e.runner.state_specs, e.runner.dtype
    budget = int(free * 0.9)  # no graphs on CPU: no reserve
    row, pg = slot_row_nbytes(specs, dt), page_nbytes(specs, 16, dt)
    snaps = min(16, int(SNAPSHOT_SHARE * budget // row))
    assert e.pool.num_pages == (budget - (4 + snaps) * row) // pg
    sizing = e.loads()["kv_sizing"]
    assert sizing["budget_bytes"] == budget and "--kv-memory-fraction 0.9" in sizing["source"]
    assert e.loads()["cuda_graphs"] == {
        "enabled": False,
        "batch_sizes": [],
        "eager_reason": "need a CUDA device, the triton kernel backend and a capture-safe model",
    }


def test_a_checkpoint_too_big_for_the_device_is_refused_before_any_weight_is_read(tmp_path, monkeypatch):
    """V4-Flash's config with a weight file as large as the release's (sparse: no disk used, and
    not a safetensors file at all — reading it would fail otherwise)."""
    model = tmp_path / "flash"
    model.mkdir()
    (model / "config.json").write_text((FLASH / "config.json").read_text())
    with open(model / "model-00001-of-00001.safetensors", "wb") as f:
        f.truncate(160 * 10**9)
    monkeypatch.setattr(kv_sizing, "device_memory", lambda device: DeviceMemory(79 * GIB, 80 * GIB))
    with pytest.raises(ValueError, match="needs at least 149.0 GiB of weights per device at --tp-size 1"):
        Engine(EngineArgs(model=str(model), device="cpu", kernel_backend="cpu"))
    assert os.path.getsize(model / "model-00001-of-00001.safetensors") == 160 * 10**9


def test_a_fraction_outside_0_1_is_refused():
    assert engine_mod.args_refusal(EngineArgs(model="m", kv_memory_fraction=1.5)) == (
        "--kv-memory-fraction must be in (0, 1], not 1.5"
    )
