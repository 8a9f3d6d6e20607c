"""Launch configuration from what the device reports, not a table of known parts: the tile
family from the opt-in shared memory and compute capability, grids that stay inside CUDA's
axis limits for any token count. Pure functions: checked on CPU with the properties of real
parts."""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels.triton_kernels import common, v4_indexer
from dsv4_kernels.triton_kernels.mla_decode import decode_config
from dsv4_kernels.triton_kernels.v4_attention import attn_grid, merge_grid

# (name, major, minor, cudaDevAttrMaxSharedMemoryPerBlockOptin bytes, tiles expected)
PARTS = [
    ("H100/H200 sm_90", 9, 0, 232448, 90),
    ("B200 sm_100", 10, 0, 232448, 100),
    ("B300 sm_103", 10, 3, 232448, 100),
    ("RTX PRO 6000 sm_120", 12, 0, 101376, 120),
    ("DGX Spark sm_121", 12, 1, 101376, 120),
    ("L40S sm_89", 8, 9, 101376, 120),
    ("A10 sm_86", 8, 6, 101376, 120),
    ("A100 sm_80", 8, 0, 166912, 120),
]


@pytest.mark.parametrize("name,major,minor,optin,want", PARTS, ids=[p[0] for p in PARTS])
def test_tiles_follow_the_devices_shared_memory_and_family(name, major, minor, optin, want):
    assert common.tile_target(major, minor, optin) == want


def test_cuda_arch_reads_the_device(monkeypatch):
    class Props:
        major, minor, shared_memory_per_block_optin = 10, 3, 232448

    common._tile_target.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props)
    try:
        assert common.cuda_arch(torch.device("cuda", 1)) == 100
        # sm_103 takes sm_100's indexer tiles (tcgen05 there crashes Triton's TMEM pass).
        assert v4_indexer.indexer_tiles(512, 2, common.cuda_arch(torch.device("cuda", 1))) == v4_indexer.indexer_tiles(
            512, 2, 100
        )
    finally:
        common._tile_target.cache_clear()
    assert common.cuda_arch(torch.device("cpu")) is None


def test_small_shared_parts_never_get_the_64_head_tiles():
    for name, major, minor, optin, _ in PARTS:
        cfg = decode_config(512, 64, common.tile_target(major, minor, optin), 2)
        assert (cfg.block_h == 64) == (optin >= common.LARGE_SHARED), name


@pytest.mark.parametrize("tokens", [1, 65535, 65536, 1_000_000])
def test_v4_attention_grids_fit_cuda_limits_for_any_token_count(tokens):
    for head_blocks in (1, 2, 4):
        grid = attn_grid(tokens, head_blocks, 3)
        assert grid == (tokens, 3, head_blocks) and all(n <= common.MAX_GRID_YZ for n in grid[1:])
    assert merge_grid(tokens, 64)[1] == 64
    with pytest.raises(ValueError, match="axis 1"):
        common.check_grid((1, 70_000))


def test_blocks_per_sm_come_from_the_compiled_kernel(monkeypatch):
    # sm_120: ~100 KiB of shared memory an SM; a 60 KB block fits once (the configs guessed 2).
    assert common.occupancy(60_000, 128, 8, 102_400, 65_536, 1536) == 1
    # Hopper: 228 KiB an SM; 8 warps x 128 registers cap it at 2.
    assert common.occupancy(60_000, 128, 8, 233_472, 65_536, 2048) == 2
    assert common.occupancy(0, 0, 4, 233_472, 65_536, 2048) == 16

    class Props:
        shared_memory_per_multiprocessor, regs_per_multiprocessor, max_threads_per_multi_processor = (
            102_400,
            65_536,
            1536,
        )

    class Compiled:
        class metadata:
            shared = 60_000

        n_regs = 128

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props)
    monkeypatch.setattr(common, "_RESIDENT", {})
    key = ("mla_decode_split", "cfg", torch.bfloat16, torch.device("cuda", 0))
    assert common.programs_per_sm(key, 2) == 2  # before the first launch: the config's guess
    common.note_occupancy(key, Compiled, torch.device("cuda", 0), 8)
    assert common.programs_per_sm(key, 2) == 1
    common.note_occupancy(("other",), None, torch.device("cpu"), 8)  # off CUDA: nothing measured
    assert common.programs_per_sm(("other",), 2) == 2


def test_split_k_waves_shrink_to_the_measured_occupancy(monkeypatch):
    from dsv4_kernels.triton_kernels import mla_decode

    monkeypatch.setattr(mla_decode, "sm_count", lambda device: 188)  # RTX PRO 6000: 188 SMs
    cfg = mla_decode.decode_config(512, 16, 120, 2)
    guessed = mla_decode.default_num_splits(4, 1, 8192, cfg, torch.device("cuda", 0))
    measured = mla_decode.default_num_splits(4, 1, 8192, cfg, torch.device("cuda", 0), resident=1)
    assert cfg.programs_per_sm == 2 and guessed == 64  # 188 x 2 slots / 4 requests, capped at MAX_SPLITS
    assert measured == 188 // 4  # one wave of 188 resident blocks, not two
