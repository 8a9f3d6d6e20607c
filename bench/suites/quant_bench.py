#!/usr/bin/env python
"""Quantized weights side by side: bf16 against block-scaled fp8 (w8a8) and fp4 experts (w4a16).

    python -m bench.suites.quant_bench --out bench/results/quant_bench.json         # CUDA machine
    python -m bench.suites.quant_bench --cpu --quick --out /tmp/quant_cpu.json      # CPU smoke

On CUDA: DeepSeek-V3 linear shapes (q_b 24576x1536, o_proj 7168x16384, kv_a 576x7168) at 1..4096
tokens, bf16 F.linear against the fp8 Triton GEMM (activation quantization included), and routed
experts (hidden 7168, intermediate 2048, 64 experts, top-8) at 1..1024 tokens: the bf16 Triton
experts against the fp8 and fp4 ones. Each time is the best of N (triton's do_bench, L2 cleared).
Weight bytes per format are reported next to the times: decode is bound by reading them.
On CPU (--cpu): the torch references at small shapes, to show what the engine's CPU choice
(dequantize once at load) saves over dequantizing per use. JSON plus a PNG next to it.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


from dsv4_kernels import reference_quant as ref  # noqa: E402
from bench.harness.report import grouped_bars, pyplot, write_json  # noqa: E402


def best_of(fn, device: torch.device, reps: int) -> float:
    """Best seconds per call over reps (after one warm-up)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=5, rep=max(20, reps), return_mode="min") / 1e3
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def fp8_weight(n: int, k: int, device, gen) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bf16 weight, e4m3 weight, per-row fp32 scales) of one random matrix."""
    w = torch.randn(n, k, generator=gen) / k**0.5
    q, s = ref.fp8_act_quant(w, 128)  # per-row groups: a valid (finer) scale layout for the kernel
    return w.to(torch.bfloat16).to(device), q.to(device), s.to(device)


def fp4_weight(n: int, k: int, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.int64).to(torch.uint8)
    exps = torch.full((n, k // 32), 120, dtype=torch.uint8)
    return codes.to(device), exps.to(device)


def bench_linear(device, shapes, tokens_list, reps, gen) -> list[dict]:
    rows = []
    for name, (n, k) in shapes.items():
        w, q, s = fp8_weight(n, k, device, gen)
        for m in tokens_list:
            x = (
                torch.randn(m, k, generator=gen)
                .to(torch.bfloat16 if device.type == "cuda" else torch.float32)
                .to(device)
            )
            row = {"weight": name, "n": n, "k": k, "tokens": m, "bf16_bytes": n * k * 2, "fp8_bytes": n * k + s.nbytes}
            if device.type == "cuda":
                from dsv4_kernels.triton_kernels.fp8_gemm import fp8_linear

                row["bf16_us"] = best_of(lambda: F.linear(x, w), device, reps) * 1e6
                row["fp8_us"] = best_of(lambda: fp8_linear(x, q, s), device, reps) * 1e6
            else:  # the CPU choice: a dense weight made once, against dequantizing at every call
                wd = ref.dequantize_fp8_rows(q, s)
                row["bf16_us"] = best_of(lambda: F.linear(x, wd), device, reps) * 1e6  # fp32 dense on CPU
                row["fp8_us"] = best_of(lambda: ref.fp8_linear(x, q, s), device, reps) * 1e6
            row["speedup_fp8"] = round(row["bf16_us"] / row["fp8_us"], 3)
            rows.append(row)
    return rows


def bench_moe(device, experts, hidden, inter, top_k, tokens_list, reps, gen) -> list[dict]:
    if device.type != "cuda":
        return []
    from dsv4_kernels.triton_kernels.fp4_gemm import fp4_moe_experts
    from dsv4_kernels.triton_kernels.fp8_gemm import fp8_moe_experts
    from dsv4_kernels.triton_kernels.moe_experts import moe_experts

    w13, q13, s13 = (torch.stack(t) for t in zip(*(fp8_weight(2 * inter, hidden, device, gen) for _ in range(experts))))
    w2, q2, s2 = (torch.stack(t) for t in zip(*(fp8_weight(hidden, inter, device, gen) for _ in range(experts))))
    p13, e13 = (torch.stack(t) for t in zip(*(fp4_weight(2 * inter, hidden, device, gen) for _ in range(experts))))
    p2, e2 = (torch.stack(t) for t in zip(*(fp4_weight(hidden, inter, device, gen) for _ in range(experts))))
    rows = []
    for t in tokens_list:
        x = torch.randn(t, hidden, generator=gen).to(torch.bfloat16).to(device)
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(t)]).to(device)
        wts = torch.rand(t, top_k, generator=gen).to(device)
        row = {"tokens": t, "experts": experts, "hidden": hidden, "inter": inter, "top_k": top_k}
        row["bf16_us"] = best_of(lambda: moe_experts(x, w13, w2, wts, ids), device, reps) * 1e6
        row["fp8_us"] = best_of(lambda: fp8_moe_experts(x, q13, s13, q2, s2, wts, ids), device, reps) * 1e6
        row["fp4_us"] = best_of(lambda: fp4_moe_experts(x, p13, e13, p2, e2, wts, ids), device, reps) * 1e6
        rows.append(row)
    return rows


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    lin = report["linear"]
    moe = report["moe"]
    fig, axes = plt.subplots(1, 2 if moe else 1, figsize=(12 if moe else 7, 4), squeeze=False)
    groups = [f"{r['weight']}\nT={r['tokens']}" for r in lin]
    dense_label = "bf16" if report["meta"]["device"] != "cpu" else "dense (dequantized once)"
    fp8_label = "fp8 w8a8" if report["meta"]["device"] != "cpu" else "fp8 per use (reference)"
    grouped_bars(
        axes[0][0],
        groups,
        {dense_label: [r["bf16_us"] for r in lin], fp8_label: [r["fp8_us"] for r in lin]},
        "linear, best of N",
        "µs (lower is better)",
    )
    if moe:
        grouped_bars(
            axes[0][1],
            [f"T={r['tokens']}" for r in moe],
            {k: [r[f"{k}_us"] for r in moe] for k in ("bf16", "fp8", "fp4")},
            "routed experts",
            "µs",
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="quantized weights: bf16 vs fp8 vs fp4")
    parser.add_argument("--cpu", action="store_true", help="torch references on CPU (no GPU needed)")
    parser.add_argument("--quick", action="store_true", help="a few small shapes (smoke test)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per point (best is kept)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/quant_bench.json"))
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --cpu (torch references) or on a GPU machine")
    device = torch.device("cpu" if args.cpu else "cuda")
    gen = torch.Generator().manual_seed(0)
    if device.type == "cuda":
        shapes = {"q_b": (24576, 1536), "o_proj": (7168, 16384), "kv_a": (576, 7168)}
        tokens = [1, 16, 128, 1024, 4096]
        moe_tokens = [1, 16, 128, 1024]
    else:
        shapes = {"q_b": (768, 256), "o_proj": (512, 1024)}
        tokens = [1, 64]
        moe_tokens = []
    if args.quick:
        shapes = dict(list(shapes.items())[: 1 if device.type == "cpu" else 2])
        tokens, moe_tokens = tokens[:2], moe_tokens[:2]
    reps = args.reps or (3 if args.quick else 10)
    report = {
        "meta": {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "quick": args.quick,
            "reps": reps,
            "timing": "best of N",
        },
        "linear": bench_linear(device, shapes, tokens, reps, gen),
        "moe": bench_moe(device, 64, 7168, 2048, 8, moe_tokens, reps, gen) if moe_tokens else [],
    }
    write_json(report, args.out)
    plot(report, args.out.with_suffix(".png"))
    for r in report["linear"]:
        print(f"linear {r['weight']:7} T={r['tokens']:5}: dense {r['bf16_us']:9.1f} µs  fp8 {r['fp8_us']:9.1f} µs")
    for r in report["moe"]:
        print(f"experts T={r['tokens']:5}: bf16 {r['bf16_us']:9.1f}  fp8 {r['fp8_us']:9.1f}  fp4 {r['fp4_us']:9.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
