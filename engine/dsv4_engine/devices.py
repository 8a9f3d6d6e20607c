"""Which CUDA device a thread launches on.

CUDA's current device belongs to each host thread and starts at 0 on a new one. Triton launches
on the thread's current device (and torch's current stream, events and graph capture follow it
too), whatever device the tensors are on: an engine on cuda:N that launches from a thread which
never chose its device runs every kernel on GPU 0 with pointers into GPU N. Every thread that
launches work therefore calls `use_device` first (the engine loop, each tensor-parallel rank,
the start-up graph capture)."""

from __future__ import annotations

import torch


def resolve(device: torch.device) -> torch.device:
    """`cuda` without an index is the current device of the thread that builds the engine:
    fix it to that index, so every later thread picks the same one."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def use_device(device: torch.device) -> None:
    """Make `device` this thread's current CUDA device (nothing to do off CUDA)."""
    if device.type == "cuda":
        torch.cuda.set_device(resolve(device))


def upload(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host numbers (a list, an array) as a tensor on `device` without the host waiting: on CUDA
    staged in pinned memory and copied non-blocking (torch's pinned allocator keeps the staging
    block until the copy is done). `torch.tensor(values, device="cuda")` copies from pageable
    memory instead, which first synchronises the stream: a wait for every queued kernel."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
