"""The kernel API the models call, in three backends (the one module of this package they import).

`dsv4_kernels.api.get_ops(backend)` returns an object whose methods are the ops (`ops.rmsnorm(...)`,
`ops.mla_decode(...)`, `ops.v4_hc_pre_tail(...)` ...):
- "torch": dsv4_kernels.ops_torch.TorchOps, pure torch, the reference every backend is tested against;
- "cpu": dsv4_kernels.ops_cpu.CpuOps, the C kernels (dsv4_kernels.native) where they apply, the
  reference where not (the default on a CPU device);
- "triton": dsv4_kernels.ops_triton.TritonOps, @triton.jit kernels (the default on CUDA); triton
  is imported only when asked for, so a CPU-only engine never pays for it.
A backend falls back to the reference per call where its own form does not apply; the models
import nothing else from this package and ask no backend what it is beyond its declared
capabilities (`expanded_prefill`, `v4_kernel_path`). `implementations()` says what runs.
"""

from __future__ import annotations

BACKENDS = ("torch", "cpu", "triton")


def get_ops(backend: str):
    """The kernel API object for `backend` (one of BACKENDS)."""
    if backend == "torch":
        from dsv4_kernels.ops_torch import TorchOps

        return TorchOps()
    if backend == "cpu":
        from dsv4_kernels.ops_cpu import CpuOps

        return CpuOps()
    if backend == "triton":
        from dsv4_kernels.ops_triton import TritonOps

        return TritonOps()
    raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")
