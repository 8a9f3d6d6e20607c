"""How big the KV pool is: the device's memory, the flags and the model's state sizes in, pages
and prefix-cache snapshots out.

Pure arithmetic (`kv_budget`, `size_pool`, `weights_refusal`); the only I/O is `device_memory`
(the device's free and total bytes) and `checkpoint_nbytes` (file sizes, no weight read), both
thin. On a device that reports its memory (CUDA) the pool takes `--kv-memory-fraction` of what
is free once this rank's weights are loaded, less a reserve for the decode CUDA graphs, on the
tightest rank of a tensor-parallel group (every rank mirrors rank 0's pool).
`--kv-memory-gb` overrides that; off CUDA it defaults to 1 GiB.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from dsv4_engine.kv_cache import page_nbytes, slot_row_nbytes
from dsv4_engine.models.state import StateSpec

GIB = 1 << 30
MIB = 1 << 20
CPU_KV_MEMORY_GB = 1.0  # --kv-memory-gb when the device reports no memory (CPU)
# Share of the KV budget the prefix cache's slot-row snapshots may take when
# --prefix-cache-snapshots is not given: the rest stays pages (context), whatever --max-num-seqs.
SNAPSHOT_SHARE = 0.25
# The decode graphs' memory pool, an estimate: a fixed part (the captured forwards' activations,
# workspace of the kernels, NCCL buffers at tp > 1) plus the logits of every padded row, kept
# per bucket in float32. bench/gpu_kernels.sh prints the measured pool next to it.
GRAPH_RESERVE_FIXED = 768 * MIB


@dataclass(frozen=True)
class DeviceMemory:
    """One device's memory as the driver reports it (bytes)."""

    free: int
    total: int


@dataclass(frozen=True)
class KVBudget:
    """Bytes the pool may take, and where the figure came from (for the log and /v1/loads)."""

    nbytes: int
    source: str


@dataclass(frozen=True)
class PoolSize:
    num_pages: int
    num_snapshots: int
    budget: KVBudget
    snapshots_capped: bool = False  # fewer snapshots than asked by default: SNAPSHOT_SHARE

    def describe(self) -> dict:
        return {
            "budget_bytes": self.budget.nbytes,
            "source": self.budget.source,
            "num_pages": self.num_pages,
            "num_snapshots": self.num_snapshots,
            "snapshots_capped": self.snapshots_capped,
        }


def graph_reserve_bytes(graph_max_bs: int, vocab_size: int, speculative: bool = False) -> int:
    """Memory set aside for the decode graphs (0 with graphs off); a speculating engine captures
    up to three sets instead (verify, draft, V4's catch-up)."""
    if graph_max_bs <= 0:
        return 0
    return (3 if speculative else 1) * (GRAPH_RESERVE_FIXED + 2 * graph_max_bs * vocab_size * 4)


def tightest(ranks: list[DeviceMemory]) -> DeviceMemory:
    """The rank with the least free memory (its total with it): what every rank's pool must fit."""
    return min(ranks, key=lambda d: d.free)


def kv_budget(
    memory_gb: Optional[float],
    fraction: float,
    device: Optional[DeviceMemory],
    graph_reserve: int = 0,
) -> KVBudget:
    """The pool's bytes: --kv-memory-gb when given (or when the device reports no memory: 1 GiB),
    else `fraction` of the free memory after weights less the graph reserve. Raises ValueError
    (one line, what to change) when that leaves nothing."""
    if memory_gb is not None:
        return KVBudget(int(memory_gb * GIB), f"--kv-memory-gb {memory_gb:g}")
    if device is None:
        return KVBudget(int(CPU_KV_MEMORY_GB * GIB), f"{CPU_KV_MEMORY_GB:g} GiB (no device memory to size from)")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"--kv-memory-fraction must be in (0, 1], not {fraction:g}")
    nbytes = int(device.free * fraction) - graph_reserve
    source = (
        f"--kv-memory-fraction {fraction:g} of {device.free / GIB:.2f} GiB free after weights "
        f"(of {device.total / GIB:.2f} GiB) less {graph_reserve / GIB:.2f} GiB for CUDA graphs"
    )
    if nbytes <= 0:
        raise ValueError(
            f"no memory left for the KV pool: {source}; raise --tp-size (fewer weights per device), "
            "lower --cuda-graph-max-bs or raise --kv-memory-fraction"
        )
    return KVBudget(nbytes, source)


def size_pool(
    specs: list[StateSpec],
    page_size: int,
    dtype: torch.dtype,
    budget: KVBudget,
    max_num_seqs: int,
    snapshots: Optional[int],
    default_snapshots: int = 0,
) -> PoolSize:
    """Pages and snapshots in `budget`: slot rows of max_num_seqs requests first, then the
    snapshots (`snapshots` when given, else `default_snapshots` capped at SNAPSHOT_SHARE of the
    budget), then pages. Raises ValueError (one line, what to change) when not one page fits."""
    row = slot_row_nbytes(specs, dtype)
    page = page_nbytes(specs, page_size, dtype)
    capped = False
    if snapshots is None:
        snapshots = default_snapshots
        if row and snapshots * row > SNAPSHOT_SHARE * budget.nbytes:
            snapshots, capped = int(SNAPSHOT_SHARE * budget.nbytes // row), True
    left = budget.nbytes - (max_num_seqs + snapshots) * row
    if left < page:
        also = f" and {snapshots} prefix-cache snapshots" if snapshots else ""
        raise ValueError(
            f"the KV pool ({budget.source}: {budget.nbytes / GIB:.2f} GiB) does not hold the per-request state of "
            f"--max-num-seqs {max_num_seqs}{also} ({row / MIB:.2f} MiB each) and one page ({page / MIB:.2f} MiB); "
            "lower --max-num-seqs or --prefix-cache-snapshots, or give the pool more memory (--kv-memory-gb, "
            "--kv-memory-fraction, --tp-size)"
        )
    return PoolSize(int(left // page), snapshots, budget, capped)


def weights_refusal(
    weight_bytes_per_rank: int,
    device: Optional[DeviceMemory],
    fraction: float,
    memory_gb: Optional[float],
    min_kv_bytes: int,
    graph_reserve: int,
    tp_size: int,
) -> Optional[str]:
    """Why this checkpoint cannot fit the device, judged before any weight is read, in one line
    with what to change, or None. `weight_bytes_per_rank` is a floor (the checkpoint's bytes over
    --tp-size: replicated tensors only add to it), so a refusal here is certain."""
    if device is None:
        return None
    kv = int(memory_gb * GIB) if memory_gb is not None else min_kv_bytes
    usable = device.free if memory_gb is not None else int(device.free * fraction)
    need = weight_bytes_per_rank + kv + graph_reserve
    if need <= usable:
        return None
    what = "--kv-memory-gb" if memory_gb is not None else "the smallest KV pool (slot rows + one page)"
    return (
        f"the checkpoint needs at least {weight_bytes_per_rank / GIB:.1f} GiB of weights per device at --tp-size "
        f"{tp_size}, plus {kv / GIB:.2f} GiB for {what} and {graph_reserve / GIB:.2f} GiB for CUDA graphs, but "
        f"{usable / GIB:.1f} GiB of the device's {device.free / GIB:.1f} GiB free may be used; raise --tp-size, "
        "lower --max-num-seqs or --cuda-graph-max-bs, or free the device"
    )


# ---- I/O shells ---------------------------------------------------------------------------------


def device_memory(device: torch.device) -> Optional[DeviceMemory]:
    """Free and total bytes of a CUDA device now (None off CUDA: nothing to size from)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(int(free), int(total))


def checkpoint_nbytes(model_dir: str | os.PathLike) -> int:
    """Bytes of the checkpoint's weight files (their sizes on disk, nothing read)."""
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def fraction_refusal(fraction: float) -> Optional[str]:
    if not 0.0 < fraction <= 1.0:
        return f"--kv-memory-fraction must be in (0, 1], not {fraction:g}"
    return None
