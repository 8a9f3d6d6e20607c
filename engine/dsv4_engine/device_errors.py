"""Which errors of a step mean the device itself is gone.

After an illegal memory access, a device-side assert or a launch failure the CUDA context is
poisoned: every later launch fails, so an engine that fails only the batch and keeps serving
answers /health while it can serve nothing. Such an error fails the engine instead (its health,
then its process; the router migrates its requests as on any engine death). Out of memory is
not one of them: the context survives, and the batch alone fails.
"""

from __future__ import annotations

from typing import Optional

import torch

# What the CUDA runtime, cuBLAS and NCCL say of a context that no longer works (torch raises
# `torch.AcceleratorError` for CUDA runtime errors; older paths and extensions raise a RuntimeError).
FATAL_MARKERS = (
    "CUDA error",
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "illegal instruction",
    "misaligned address",
    "CUBLAS_STATUS_EXECUTION_FAILED",
    "NCCL error",
    "uncorrectable ECC error",
)


def device_failure(exc: BaseException) -> Optional[str]:
    """One line naming the device failure `exc` is, or None for an error of the batch alone."""
    if isinstance(exc, torch.OutOfMemoryError):
        return None
    text = str(exc).strip()
    accelerator = getattr(torch, "AcceleratorError", None)
    if (accelerator is not None and isinstance(exc, accelerator)) or any(m in text for m in FATAL_MARKERS):
        first = (text.splitlines() or [""])[0][:300]
        return f"{type(exc).__name__}: {first}"
    return None
