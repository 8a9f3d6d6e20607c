"""Kernels for the engine's hot paths, in two interchangeable backends.

``dsv4_kernels.reference`` is pure torch (fp32 math, vectorised; the engine's CPU backend) and
``dsv4_kernels.triton_ops`` launches @triton.jit kernels with the same function names and
signatures. ``get_ops(backend)`` picks one; triton is imported only when asked for, so a
CPU-only engine never pays for it.
"""

from __future__ import annotations

from types import ModuleType

BACKENDS = ("torch", "triton")


def get_ops(backend: str) -> ModuleType:
    """Return the module implementing the kernel API for ``backend`` ("torch" or "triton")."""
    if backend == "torch":
        from dsv4_kernels import reference

        return reference
    if backend == "triton":
        from dsv4_kernels import triton_ops

        return triton_ops
    raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")
