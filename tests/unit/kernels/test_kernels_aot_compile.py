"""Every Triton kernel compiles to real GPU code for Hopper (sm_90) and Blackwell (sm_100,
sm_120) with the ptxas in the triton wheel, no GPU needed, within each target's registers
and shared memory and without spilling."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "compile_kernels.py"


def load_compile_script():
    spec = importlib.util.spec_from_file_location("compile_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("compile_kernels", module)
    spec.loader.exec_module(module)
    return module


def kernels_defined(module) -> set[str]:
    """The @triton.jit functions a kernel module defines (compiled or interpreted)."""
    return {
        name
        for name, obj in vars(module).items()
        if name.endswith("_kernel") and hasattr(obj, "fn") and inspect.getmodule(obj.fn) is module
    }


def test_every_kernel_has_an_aot_variant_on_every_target():
    script = load_compile_script()
    for arch in script.ARCHS:
        compiled = {(v.kernel.fn.__module__, v.kernel.fn.__name__) for v in script.variants(arch)}
        for module in script.KERNEL_MODULES:
            for name in kernels_defined(module):
                assert (module.__name__, name) in compiled, f"{module.__name__}.{name} has no AOT variant for sm_{arch}"


# The default run compiles for sm_120 (the users' RTX PRO 6000 Blackwell: the tightest shared
# memory of the three, about 99 KB a block); Hopper and datacentre Blackwell run with -m slow
# (the three together take about two minutes on 2 cores).
@pytest.mark.parametrize(
    "arch", [pytest.param(90, marks=pytest.mark.slow), pytest.param(100, marks=pytest.mark.slow), 120]
)
def test_kernels_compile_for_hopper_and_blackwell_within_limits(arch):
    script = load_compile_script()
    reports = script.compile_all((arch,))
    print("\n" + script.format_table(reports))
    names = [r["kernel"] for r in reports if r["arch"] == f"sm_{arch}"]
    assert names == [v.name for v in script.variants(arch)]
    for report in reports:
        assert report["registers"] > 0
        assert script.problems(report) == [], report
        # The GEMM-shaped kernels pipeline their loads, and in bf16 take tensor cores (fp32
        # asks for exact products: FMA units).
        if report["kernel"].startswith(
            (
                "mla_decode_split",
                "mla_extend",
                "moe_gate_up",
                "moe_down",
                "v4_attn[",
                "v4_indexer_topk[",
            )
        ):
            # fp32 over FP8 KV (exactness mode) fits its registers with one stage only
            assert report["pipelined"] or report["kernel"].startswith("v4_attn[fp32,fp8kv"), report
            assert (report["mma"] != "-") == ("bf16" in report["kernel"]), report
        # The quantized-weight GEMMs take tensor cores (fp8 x fp8, or decoded fp4 in bf16); fp4
        # against fp32 activations asks for exact fp32 products (FMA units), like the fp32 GEMMs.
        if report["kernel"].startswith(("fp8_gemm", "fp4_gemm")):
            fma = report["kernel"].startswith("fp4_gemm[fp32")
            assert report["pipelined"] and (report["mma"] == "-") == fma, report


def test_problems_flags_spills_and_shared_memory_overflow():
    script = load_compile_script()
    ok = {"registers": 128, "spill_bytes": 0, "shared_bytes": 50_000, "shared_limit": 101376, "arch": "sm_120"}
    assert script.problems(ok) == []
    assert script.problems({**ok, "spill_bytes": 64})
    assert script.problems({**ok, "shared_bytes": 150_000})


# Kernels whose inputs have one dtype whatever the engine's: DeepSeek-V3's router gets fp32
# logits (the gate runs in fp32, deepseek_v3._moe).
ONE_DTYPE = {"moe_route_kernel"}
# Kernels that never read an activation: the indexer's merge folds int64 candidates.
NO_DTYPE = {"v4_indexer_merge_kernel"}


def test_every_kernel_is_compiled_in_each_dtype_the_engine_can_launch_it_in():
    """bfloat16 (the default on CUDA) and float32 (--dtype float32): a kernel compiled in one
    only would meet the other untested on the first GPU run (fp4 with fp32 activations spilled)."""
    script = load_compile_script()
    for arch in script.ARCHS:
        dtypes: dict[str, set[str]] = {}
        for v in script.variants(arch):
            label = v.name.split("[", 1)[1].rstrip("]")
            dtypes.setdefault(v.kernel.fn.__name__, set()).update(d for d in ("bf16", "fp32") if d in label.split(","))
        for name, seen in dtypes.items():
            if name in NO_DTYPE:
                continue
            want = {"fp32"} if name in ONE_DTYPE else {"bf16", "fp32"}
            assert seen >= want, f"{name} has AOT variants in {sorted(seen)} for sm_{arch}, not {sorted(want)}"
