#!/usr/bin/env python
"""Compile every dsv4 Triton kernel ahead of time for real GPU targets, no GPU needed.

Each kernel module lists the variants it launches in production (aot_variants); this builds
them with triton.compile for sm_90 (Hopper), sm_100 and sm_120 (Blackwell) using the ptxas in
the triton wheel, and reports registers, spills and shared memory per kernel. A variant that
does not compile, spills, or needs more shared memory than the target has is a failure.

    python scripts/compile_kernels.py [--arch 90 100 120] [--json out.json] [--markdown table.md]

Each target compiles in its own child process, concurrently: triton.compile cannot run in a
process that has used TRITON_INTERPRET (the interpreter patches triton.language), so the
children run without it, and tests under the interpreter can call compile_all.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from dsv4_kernels.triton_kernels import (
    fp4_gemm,
    fp8_gemm,
    mla_decode,
    mla_extend,
    moe_experts,
    moe_route,
    rmsnorm,
    rope,
)
from dsv4_kernels.triton_kernels import v4_attention, v4_compress, v4_indexer, v4_mhc, v4_moe_route
from dsv4_kernels.triton_kernels.common import SHARED_LIMIT, KernelVariant

ARCHS = (90, 100, 120)
KERNEL_MODULES = (
    mla_decode,
    mla_extend,
    moe_route,
    moe_experts,
    rmsnorm,
    rope,
    v4_attention,
    v4_indexer,
    v4_compress,
    v4_mhc,
    v4_moe_route,
    fp8_gemm,
    fp4_gemm,
)
MAX_REGISTERS = 255


def variants(arch: int) -> list[KernelVariant]:
    return [v for module in KERNEL_MODULES for v in module.aot_variants(arch)]


def _as_jit(kernel) -> JITFunction:
    """Under TRITON_INTERPRET=1 the decorated kernels are interpreter objects; compile the
    Python function underneath instead."""
    return kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)


def _resource_usage(cubin: bytes) -> dict[str, int]:
    """REG/LOCAL/SHARED of the (single) function in a cubin, as cuobjdump reports them."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    usage = dict(re.findall(r"\b(REG|LOCAL|STACK|SHARED):(\d+)", text))
    return {k: int(v) for k, v in usage.items()}


def _mma_kind(ttgir: str) -> str:
    """Which tensor-core path the kernel's dots took (none for kernels without dots)."""
    for marker, kind in (("tc_gen5_mma", "tcgen05"), ("warp_group_dot", "wgmma"), ("nvidia_mma", "mma.sync")):
        if marker in ttgir:
            return kind
    return "-"


def compile_variant(variant: KernelVariant, arch: int) -> dict:
    """Compile one variant for sm_<arch>; returns its resource report (raises if it fails)."""
    fn = _as_jit(variant.kernel)
    signature = variant.signature(fn.arg_names)
    attrs = {(i,): [["tt.divisibility", 16]] for i in variant.divisible_args(fn.arg_names)}
    started = time.perf_counter()
    compiled = triton.compile(
        ASTSource(fn, signature, constexprs=variant.constexprs, attrs=attrs),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": variant.num_warps, "num_stages": variant.num_stages},
    )
    usage = _resource_usage(compiled.asm["cubin"])
    shared = int(compiled.metadata.shared)
    return {
        "kernel": variant.name,
        "arch": f"sm_{arch}",
        "registers": usage.get("REG", 0),
        # Spilled registers live in the stack frame (STACK) or local memory (LOCAL).
        "spill_bytes": usage.get("STACK", 0) + usage.get("LOCAL", 0),
        "shared_bytes": shared,
        "shared_limit": SHARED_LIMIT.get(arch),
        "num_warps": variant.num_warps,
        "num_stages": variant.num_stages,
        "mma": _mma_kind(compiled.asm.get("ttgir", "")),
        "pipelined": "async_copy_global_to_local" in compiled.asm.get("ttgir", ""),
        "compile_s": round(time.perf_counter() - started, 2),
    }


def problems(report: dict) -> list[str]:
    """Why a compiled variant would fail or misbehave on its target."""
    found = []
    if report["registers"] > MAX_REGISTERS:
        found.append(f"{report['registers']} registers")
    if report["spill_bytes"]:
        found.append(f"spills {report['spill_bytes']} bytes to local memory")
    if report["shared_limit"] and report["shared_bytes"] > report["shared_limit"]:
        found.append(f"needs {report['shared_bytes']} B shared memory, {report['arch']} has {report['shared_limit']}")
    return found


def compile_target(arch: int) -> list[dict]:
    """Compile every kernel variant for one target, in this process (no interpreter here)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_target needs a process without TRITON_INTERPRET; use compile_all")
    return [compile_variant(v, arch) for v in variants(arch)]


def compile_all(archs: tuple[int, ...] = ARCHS, timeout: float = 600) -> list[dict]:
    """Compile every kernel variant for every target, one child process per target running
    concurrently; returns one report per (variant, arch). Raises if a child fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", "--arch", str(arch)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for arch in archs
    ]
    reports = []
    for arch, child in zip(archs, children):
        out, err = child.communicate(timeout=timeout)
        if child.returncode != 0:
            raise RuntimeError(f"compiling for sm_{arch} failed:\n{err[-4000:]}")
        reports.extend(json.loads(out))
    return reports


def format_table(reports: list[dict]) -> str:
    lines = [f"{'kernel':36} {'arch':7} {'regs':>4} {'spill':>5} {'smem':>7} {'warps':>5} {'mma':>8} {'pipelined':>9}"]
    for r in reports:
        lines.append(
            f"{r['kernel']:36} {r['arch']:7} {r['registers']:>4} {r['spill_bytes']:>5} "
            f"{r['shared_bytes']:>7} {r['num_warps']:>5} {r['mma']:>8} {str(r['pipelined']):>9}"
        )
    return "\n".join(lines)


def format_markdown(reports: list[dict]) -> str:
    """One row a variant, one column a target: registers / spill bytes / shared memory (KiB) /
    tensor-core path (docs/gpu-path.md keeps this table)."""
    archs = sorted({r["arch"] for r in reports}, key=lambda a: int(a[3:]))
    cell = {(r["kernel"], r["arch"]): r for r in reports}
    names = list(dict.fromkeys(r["kernel"] for r in reports))
    lines = ["| variant | " + " | ".join(archs) + " |", "|---|" + "---|" * len(archs)]
    for name in names:
        row = []
        for a in archs:
            r = cell.get((name, a))
            row.append(
                "-"
                if r is None
                else f"{r['registers']} / {r['spill_bytes']} / {r['shared_bytes'] / 1024:.1f} / {r['mma']}"
            )
        lines.append(f"| `{name}` | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=list(ARCHS), help="compute capabilities (90 100 120)")
    parser.add_argument("--json", type=Path, help="write the reports here")
    parser.add_argument("--markdown", type=Path, help="write the table of docs/gpu-path.md here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # compile_all's children
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps([r for arch in args.arch for r in compile_target(arch)]))
        return 0
    reports = compile_all(tuple(args.arch))
    print(format_table(reports))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(reports, indent=2))
    if args.markdown:
        args.markdown.write_text(format_markdown(reports) + "\n")
    bad = [f"{r['kernel']} {r['arch']}: {p}" for r in reports for p in problems(r)]
    for line in bad:
        print("FAIL", line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
