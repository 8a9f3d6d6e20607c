"""Counts the places where the host would wait for the device: reads of tensor values by
Python (.item(), .tolist(), bool()/int()/float(), .cpu(), .numpy(), a copy to the CPU) and ops
whose output shape depends on tensor values (nonzero, boolean indexing, unique, bincount, ...),
which on CUDA read a count back before they can allocate.

On CPU nothing actually waits, so the probe counts the calls that *would* wait on a GPU. Calls
made by Triton's CPU interpreter (which runs the kernels in Python and reads their arguments
on the host) are not ours and are not counted.
"""

from __future__ import annotations

import sys
import traceback
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

READ_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
# Ops whose result shape depends on tensor values: on CUDA they synchronise to learn it.
SHAPE_FROM_VALUES = {
    aten.nonzero.default,
    aten.masked_select.default,
    aten._local_scalar_dense.default,
    aten.unique_dim.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.bincount.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.repeat_interleave.Tensor,
    aten.nonzero_static.default if hasattr(aten, "nonzero_static") else aten.nonzero.default,
}


def from_interpreter() -> bool:
    """Whether the caller runs on behalf of Triton's CPU interpreter."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if "/triton/" in name and "/triton/language/" not in name:
            return True
        f = f.f_back
    return False


class _ShapeOps(TorchDispatchMode):
    def __init__(self, hits: list[str]):
        super().__init__()
        self.hits = hits

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        bool_index = func is aten.index.Tensor and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or [])
        )
        to_host = (
            func in (aten._to_copy.default, aten.copy_.default)
            and isinstance(args[0], torch.Tensor)
            and args[0].device.type != "cpu"
            and (
                kwargs.get("device") == torch.device("cpu")
                or (func is aten.copy_.default and args[0].device.type == "cpu")
            )
        )
        if (func in SHAPE_FROM_VALUES and func is not aten._local_scalar_dense.default) or bool_index or to_host:
            if not from_interpreter():
                self.hits.append(f"{func} at {''.join(traceback.format_stack(limit=6)[:-1])}")
        return func(*args, **kwargs)


@contextmanager
def count_host_syncs():
    """Yields the list of host syncs (each a description with a short stack) made inside."""
    hits: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in READ_METHODS}

    def wrap(name, orig):
        def method(self, *a, **kw):
            if not from_interpreter():
                hits.append(f"Tensor.{name} at {''.join(traceback.format_stack(limit=6)[:-1])}")
            return orig(self, *a, **kw)

        return method

    for name, orig in originals.items():
        setattr(torch.Tensor, name, wrap(name, orig))
    try:
        with _ShapeOps(hits):
            yield hits
    finally:
        for name, orig in originals.items():
            setattr(torch.Tensor, name, orig)


@contextmanager
def count_blocking_uploads():
    """Yields the list of uploads of host data that would wait on a GPU: `torch.tensor(...,
    device=...)` / `torch.as_tensor(..., device=...)` of host numbers. From pageable memory CUDA
    first synchronises the stream (the host waits for every queued kernel); `devices.upload`
    stages in pinned memory instead. On CPU the device is the host, so the calls are what is
    counted, as for host reads. (`Tensor.to(device)` of a host tensor is not counted: on CPU it
    cannot be told from a no-op `.to` of a tensor already on the device.)"""
    hits: list[str] = []
    made = {"tensor": torch.tensor, "as_tensor": torch.as_tensor}

    def creating(name, orig):
        def fn(data, *a, **kw):
            if kw.get("device") is not None and not isinstance(data, torch.Tensor) and not from_interpreter():
                hits.append(f"torch.{name}(device=...) at {''.join(traceback.format_stack(limit=6)[:-1])}")
            return orig(data, *a, **kw)

        return fn

    torch.tensor, torch.as_tensor = creating("tensor", made["tensor"]), creating("as_tensor", made["as_tensor"])
    try:
        yield hits
    finally:
        torch.tensor, torch.as_tensor = made["tensor"], made["as_tensor"]
