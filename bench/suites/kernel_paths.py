"""The kernels of issue 49 ("kernels that fill the device") on a real GPU, as bench/gpu_kernels.sh
(PARTS=kernels) runs them: one line per path, `CHECK <name>: PASS|FAIL <figures>`, and one JSON.

  - indexer_split: the V4 indexer (V4-Flash: 64 heads of 128, top-512) at decode, 32k context,
    batch 1 and 4: the split scan + merge picks exactly what one split (S = 1) picks; both timed;
  - hc_pre_split: v4_hc_pre at batch 1 (4 streams of 4096): the column-split kernels against the
    torch reference and the fused kernel; both timed;
  - moe_tp_rows: fp4 experts as rank 0 of TP 8 (32 of 256 experts, top-6, batch 64): equal to
    the reference, and the down GEMM leaves other ranks' rows of a NaN-filled output untouched;
  - fp4_native: which fp4 path this device takes (tl.dot_scaled on sm_100's tile family, the
    registers decode elsewhere); where it is dot_scaled, its expert and dense GEMMs against the
    decode path (DSV4_FP4_NATIVE=0), both timed.

    python -m bench.suites.kernel_paths [--check NAME ...] [--out bench/results/kernel_paths.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

CHECKS = ("indexer_split", "hc_pre_split", "moe_tp_rows", "fp4_native")


def line(name: str, ok: bool, detail: str) -> dict:
    print(f"CHECK {name}: {'PASS' if ok else 'FAIL'} {detail}", flush=True)
    return {"check": name, "ok": ok, "detail": detail}


def time_ms(fn, reps: int = 20) -> float:
    """Best of `reps` timed calls after a warm-up (CUDA events)."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def indexer_split() -> dict:
    from dsv4_kernels.triton_kernels import v4_indexer as tk

    dev, gen = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    heads, dim, rate, page, top_k, context = 64, 128, 4, 64, 512, 32768
    figures, ok = {}, True
    for batch in (1, 4):
        pages = context // page
        store = torch.randn(batch * pages + 1, page // rate, dim, device=dev, generator=gen).bfloat16()
        table = torch.randperm(batch * pages, device=dev, generator=gen).view(batch, pages).int()
        args = dict(
            iq=torch.randn(batch, heads, dim, device=dev, generator=gen).bfloat16(),
            iw=torch.randn(batch, heads, device=dev, generator=gen) * heads**-0.5,
            index_k=store,
            block_table=table,
            positions=torch.full((batch,), context - 1, device=dev),
            extend_lens=torch.ones(batch, dtype=torch.int64, device=dev),
            top_k=top_k,
            scale=dim**-0.5,
            rate=rate,
            page_size=page,
        )
        split, serial = tk.v4_indexer_topk(**args), tk.v4_indexer_topk(**args, num_splits=1)
        ok &= torch.equal(split, serial)
        figures[f"b{batch}"] = {
            "serial_ms": time_ms(lambda: tk.v4_indexer_topk(**args, num_splits=1)),
            "split_ms": time_ms(lambda: tk.v4_indexer_topk(**args)),
        }
    detail = " ".join(f"{k}: {v['serial_ms']:.3f} -> {v['split_ms']:.3f} ms" for k, v in figures.items())
    return {**line("indexer_split", ok, f"picks equal one split's; {detail}"), **figures}


def hc_pre_split() -> dict:
    from dsv4_kernels import reference_v4 as ref
    from dsv4_kernels.triton_kernels import v4_mhc as mk

    dev, gen = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(1)
    hc, dim = 4, 4096
    x = torch.randn(1, hc, dim, device=dev, generator=gen).bfloat16()
    fn = torch.randn((2 + hc) * hc, hc * dim, device=dev, generator=gen) * (hc * dim) ** -0.5
    base = torch.randn((2 + hc) * hc, device=dev, generator=gen) * 0.5
    scale = torch.tensor([0.7, 1.3, 2.0], device=dev)
    args = (x, fn, base, scale, 1e-6, 1e-6, 20)
    want = ref.v4_hc_pre(*args)
    got = mk.v4_hc_pre(*args)
    ok = all(torch.allclose(g.float(), w.float(), atol=2e-2, rtol=2e-2) for g, w in zip(got, want))
    ok &= torch.allclose(got[1], want[1], atol=1e-4, rtol=1e-4)  # comb: fp32 throughout
    fused_ms = time_ms(lambda: mk.v4_hc_pre(*args, num_splits=1))
    split_ms = time_ms(lambda: mk.v4_hc_pre(*args))
    detail = f"== reference at batch 1; fused {fused_ms:.3f} -> split {split_ms:.3f} ms"
    return {**line("hc_pre_split", ok, detail), "fused_ms": fused_ms, "split_ms": split_ms}


def fp4_experts(local: int, hidden: int, inter: int, gen: torch.Generator):
    dev = torch.device("cuda")

    def weights(n: int, k: int):
        codes = torch.randint(0, 256, (local, n, k // 2), device=dev, generator=gen).to(torch.uint8)
        return codes, torch.randint(118, 122, (local, n, k // 32), device=dev, generator=gen).to(torch.uint8)

    return (*weights(2 * inter, hidden), *weights(hidden, inter))


def moe_tp_rows() -> dict:
    from dsv4_kernels import reference_quant as ref
    from dsv4_kernels.triton_kernels import fp4_gemm, moe_experts

    dev, gen = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(2)
    tokens, top_k, experts, tp, hidden, inter = 64, 6, 256, 8, 4096, 2048
    local = experts // tp
    w13, s13, w2, s2 = fp4_experts(local, hidden, inter, gen)
    ids = torch.rand(tokens, experts, device=dev, generator=gen).topk(top_k, dim=1).indices
    ids = torch.where(ids < local, ids, -1)
    wts = torch.rand(tokens, top_k, device=dev, generator=gen)
    x = torch.randn(tokens, hidden, device=dev, generator=gen).bfloat16()
    got = fp4_gemm.fp4_moe_experts(x, w13, s13, w2, s2, wts, ids, 10.0)
    want = ref.fp4_moe_experts(x, w13, s13, w2, s2, wts, ids, 10.0)
    close = torch.allclose(got.float(), want.float(), atol=5e-2, rtol=5e-2)
    tiles = fp4_gemm.fp4_blocks(ids.numel() // local)
    pairs, block_expert = moe_experts.align_pairs_by_expert(ids, local, tiles[0])
    inter_rows = torch.randn(ids.numel(), inter, device=dev, generator=gen).bfloat16()
    y = torch.full((ids.numel(), hidden), float("nan"), device=dev)
    fp4_gemm._launch(
        inter_rows, w2, s2, y, wts.reshape(-1).float(), pairs, block_expert, ids.numel(), hidden,
        a_div=1, dense=False, gated=False, limit=None, tiles=tiles, num_m_blocks=block_expert.shape[0],
    )  # fmt: skip
    mine = ids.reshape(-1) >= 0
    untouched = bool(torch.isnan(y[~mine]).all()) and bool(torch.isfinite(y[mine]).all())
    ms = time_ms(lambda: fp4_gemm.fp4_moe_experts(x, w13, s13, w2, s2, wts, ids, 10.0))
    share = float(mine.float().mean())
    detail = f"== reference: {close}; other ranks' rows untouched: {untouched}; {share:.0%} pairs local, {ms:.3f} ms"
    return {**line("moe_tp_rows", close and untouched, detail), "ms": ms, "local_share": share}


def fp4_native() -> dict:
    from dsv4_kernels.triton_kernels import fp4_gemm
    from dsv4_kernels.triton_kernels.common import cuda_arch

    dev, gen = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(3)
    arch = cuda_arch(dev)
    if not fp4_gemm.fp4_native(arch, torch.bfloat16):
        return line("fp4_native", True, f"tile family sm_{arch}: the registers decode (fall-back), as selected")
    tokens, top_k, local, hidden, inter = 64, 6, 32, 4096, 2048
    w13, s13, w2, s2 = fp4_experts(local, hidden, inter, gen)
    ids = torch.randint(0, local, (tokens, top_k), device=dev, generator=gen)
    wts = torch.rand(tokens, top_k, device=dev, generator=gen)
    x = torch.randn(tokens, hidden, device=dev, generator=gen).bfloat16()
    runs = {
        "experts": lambda: fp4_gemm.fp4_moe_experts(x, w13, s13, w2, s2, wts, ids, 10.0),
        "dense": lambda: fp4_gemm.fp4_linear(x, w13[0], s13[0]),
    }
    figures, ok = {}, True
    for name, run in runs.items():
        native, native_ms = run(), time_ms(run)
        os.environ["DSV4_FP4_NATIVE"] = "0"
        try:
            decode, decode_ms = run(), time_ms(run)
        finally:
            del os.environ["DSV4_FP4_NATIVE"]
        ok &= torch.allclose(native.float(), decode.float(), atol=5e-2, rtol=5e-2)
        figures[name] = {"decode_ms": decode_ms, "native_ms": native_ms}
    detail = " ".join(
        f"{k}: decode {v['decode_ms']:.3f} -> dot_scaled {v['native_ms']:.3f} ms" for k, v in figures.items()
    )
    return {**line("fp4_native", ok, f"sm_{arch} dot_scaled == decode path; {detail}"), **figures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", nargs="+", choices=CHECKS, default=list(CHECKS))
    parser.add_argument("--out", type=Path, help="write the results here (JSON)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_paths needs a CUDA device; on CPU the same paths run in tests/unit/kernels", file=sys.stderr)
        return 2
    results = []
    for name in args.check:
        try:
            results.append(globals()[name]())
        except Exception as exc:  # one failing path must not hide the others' lines
            results.append(line(name, False, f"{type(exc).__name__}: {exc}"))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "checks": results}, indent=2))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
