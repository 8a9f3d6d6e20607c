"""What every launcher shares: interpreter handling, device facts, and the description of a
kernel variant for ahead-of-time compilation."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.runtime.jit import JITFunction


def on_interpreter(t: torch.Tensor) -> bool:
    """Kernels on CPU tensors run under TRITON_INTERPRET=1, whose bf16 dot is broken:
    launchers then ask kernels to upcast dot operands to fp32. (Every dot in these kernels
    asks for input_precision="ieee": fp32 is the engine's correctness mode, and bf16
    operands take tensor cores regardless.)"""
    return t.device.type != "cuda"


def check_launchable(kernel: Any, t: torch.Tensor) -> None:
    """Compiled kernels need CUDA tensors; CPU tensors need the interpreter, which triton picks
    when a kernel module is imported. Say so instead of failing deep inside triton."""
    if t.device.type != "cuda" and isinstance(kernel, JITFunction):
        raise RuntimeError(
            "dsv4_kernels.triton_ops got CPU tensors but its kernels were compiled for a GPU: "
            "set TRITON_INTERPRET=1 before dsv4_kernels.triton_ops is first imported, or use the torch backend"
        )


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a small stand-in under the interpreter, where
    every extra program costs CPU time."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def cuda_arch(device: torch.device) -> int | None:
    """Compute capability as an int (90, 100, 120), or None off CUDA."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


# Shared memory a block may use, by compute capability (bytes). sm_120 (consumer Blackwell)
# has far less than the datacenter parts, so tile choices depend on it.
SHARED_LIMIT = {90: 232448, 100: 232448, 120: 101376}


def small_shared(arch: int | None) -> bool:
    return arch is not None and SHARED_LIMIT.get(arch, 232448) < 200_000


@dataclass(frozen=True)
class KernelVariant:
    """One concrete compilation of a kernel: what scripts/compile_kernels.py builds for a GPU
    target. ``types`` gives the Triton type of each runtime argument ("*bf16", "i32", "fp32");
    ``divisible`` names integer arguments that are multiples of 16 in production, which the JIT
    would specialise on (pointers and ``stride_*`` arguments are assumed so)."""

    name: str
    kernel: Any
    types: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 2
    divisible: tuple[str, ...] = ()

    def signature(self, arg_names: list[str]) -> dict[str, str]:
        sig = {}
        for name in arg_names:
            if name in self.constexprs:
                sig[name] = "constexpr"
            elif name in self.types:
                sig[name] = self.types[name]
            else:
                raise KeyError(f"{self.name}: no type for argument {name!r}")
        extra = set(self.types) - set(arg_names)
        if extra:
            raise KeyError(f"{self.name}: types for unknown arguments {sorted(extra)}")
        return sig

    def divisible_args(self, arg_names: list[str]) -> list[int]:
        """Indices of the arguments to compile with a divisible-by-16 hint, as the JIT would."""
        types = self.signature(arg_names)
        return [
            i for i, name in enumerate(arg_names)
            if types[name].startswith("*") or (types[name] != "constexpr" and (name.startswith("stride_") or name in self.divisible))
        ]
