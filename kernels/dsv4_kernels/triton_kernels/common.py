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


# Shared memory a block may use on each AOT target (bytes), for the compile reports. sm_120
# (consumer Blackwell) has far less than the datacenter parts, so tile choices depend on it.
SHARED_LIMIT = {90: 232448, 100: 232448, 120: 101376}
LARGE_SHARED = 200_000  # the big tiles (64 heads a program) need ~210 KiB


def tile_target(major: int, minor: int, shared_optin: int) -> int:
    """Which AOT target's tiles suit a device (90, 100 or 120), from what the device says it
    has rather than a table of known parts: less than LARGE_SHARED bytes of opt-in shared
    memory a block (sm_120/121, sm_89, sm_86, sm_80...) takes sm_120's small tiles; compute
    capability 10.x/11.x (sm_100, sm_103, sm_110: tcgen05) takes sm_100's; the rest Hopper's."""
    if shared_optin < LARGE_SHARED:
        return 120
    if major in (10, 11):
        return 100
    return 90


@functools.lru_cache(maxsize=None)
def _tile_target(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return tile_target(props.major, props.minor, props.shared_memory_per_block_optin)


def cuda_arch(device: torch.device) -> int | None:
    """The AOT target (90, 100, 120) whose tiles the kernels pick on this device, or None off
    CUDA (see tile_target)."""
    if device.type != "cuda":
        return None
    return _tile_target(device.index if device.index is not None else torch.cuda.current_device())


def small_shared(arch: int | None) -> bool:
    return arch is not None and SHARED_LIMIT.get(arch, 232448) < LARGE_SHARED


def occupancy(
    shared_bytes: int, regs_per_thread: int, num_warps: int, shared_per_sm: int, regs_per_sm: int, threads_per_sm: int
) -> int:
    """Blocks of one compiled kernel resident on an SM at once: the least of what its shared
    memory, its registers and its threads allow (at least 1)."""
    threads = 32 * num_warps
    limits = [threads_per_sm // threads]
    if shared_bytes:
        limits.append(shared_per_sm // (shared_bytes + 1024))  # the driver reserves 1 KiB a block
    if regs_per_thread:
        limits.append(regs_per_sm // (regs_per_thread * threads))
    return max(1, min(limits))


# Measured blocks per SM of each (kernel, config, dtype, device) once it has compiled: split-K
# launchers size their waves with it instead of the config's guess (a 56-76 KiB block fits
# once on sm_120's ~100 KiB SM, not twice).
_RESIDENT: dict[tuple, int] = {}


def programs_per_sm(key: tuple, default: int) -> int:
    return _RESIDENT.get(key, default)


def note_occupancy(key: tuple, compiled: Any, device: torch.device, num_warps: int) -> None:
    """Record the blocks per SM of a kernel just launched (its CompiledKernel) on a CUDA device."""
    if key in _RESIDENT or device.type != "cuda" or compiled is None:
        return
    try:
        props = torch.cuda.get_device_properties(device)
        _RESIDENT[key] = occupancy(
            int(compiled.metadata.shared),
            int(getattr(compiled, "n_regs", 0) or 0),
            num_warps,
            props.shared_memory_per_multiprocessor,
            props.regs_per_multiprocessor,
            props.max_threads_per_multi_processor,
        )
    except Exception:  # a Triton or torch without these fields: keep the config's guess
        _RESIDENT[key] = 0
        del _RESIDENT[key]


MAX_GRID_YZ = 65535  # CUDA's limit on grid axes 1 and 2 (axis 0 goes to 2**31 - 1)


def check_grid(grid: tuple[int, ...]) -> tuple[int, ...]:
    """A launch grid, refused with a clear error (not a CUDA launch failure) when an axis past
    the first exceeds 65,535: whatever can grow with the batch belongs on axis 0."""
    for axis, n in enumerate(grid[1:], start=1):
        if n > MAX_GRID_YZ:
            raise ValueError(f"grid axis {axis} of {grid} exceeds CUDA's {MAX_GRID_YZ}")
    return grid


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
            i
            for i, name in enumerate(arg_names)
            if types[name].startswith("*")
            or (types[name] != "constexpr" and (name.startswith("stride_") or name in self.divisible))
        ]


def fp32_twins(variants: list[KernelVariant]) -> list[KernelVariant]:
    """The variants again with fp32 in place of bf16 activations, for kernels whose tiles do not
    depend on the dtype (elementwise and reductions): the engine launches them in either,
    bfloat16 being the default on CUDA and float32 its exactness mode."""
    twins = []
    for v in variants:
        if "bf16" not in v.name:
            continue
        types = {k: ("*fp32" if t == "*bf16" else t) for k, t in v.types.items()}
        twins.append(
            KernelVariant(
                name=v.name.replace("bf16", "fp32"),
                kernel=v.kernel,
                types=types,
                constexprs=v.constexprs,
                num_warps=v.num_warps,
                num_stages=v.num_stages,
                divisible=v.divisible,
            )
        )
    names = {v.name for v in variants}
    return variants + [t for t in twins if t.name not in names]
