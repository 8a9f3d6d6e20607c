#!/usr/bin/env python
"""Kernel benchmarks: mla_decode memory bandwidth and MoE expert throughput, Triton kernels
against the torch reference, written as JSON.

    python -m bench.suites.kernels_bench --out bench/results/kernels_bench.json      # CUDA machine
    python -m bench.suites.kernels_bench --cpu --quick --out /tmp/kernels_cpu.json   # torch backend on CPU

On CUDA: mla_decode at the real latent width (512 + 64, bf16, page 64) for batch 1..128 and
context 1k..32k, as achieved GB/s (KV bytes read + q + out over time) and as a share of the
card's nominal bandwidth and of a measured device-to-device copy; a split/tile sweep at
batch 64, context 4k (the acceptance point: >= 70% of nominal bandwidth); MoE experts at
DeepSeek-V3 sizes (hidden 7168, intermediate 2048, top-8) as TFLOP/s and weight GB/s, against
the torch reference and a plain bf16 torch loop. Timings are medians; on CUDA triton's
do_bench clears L2 between runs, so bandwidth is from HBM.
DeepSeek-V4 (also alone with --only v4): decode attention per layer type (V4-Flash: 64 heads of
512, window 128, CSA top-512 of context // 4 entries, HCA every context // 128 entry, sliding
only) as GB/s of the bytes it must move and % of nominal bandwidth (the acceptance point: CSA at
batch 64, context 4k, >= 70%), and the lightning indexer (64 x 128, top-512) at decode.
On CPU (--cpu) only the torch reference runs: it is the engine's CPU backend.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


from dsv4_kernels import reference  # noqa: E402

# Nominal HBM bandwidth (GB/s) by device-name fragment; the longest matching fragment wins.
NOMINAL_GBPS = {
    "H200": 4800,
    "H100 NVL": 3900,
    "H100 PCIe": 2000,
    "H100": 3350,
    "H800": 3350,
    "H20": 4000,
    "GB300": 8000,
    "B300": 8000,
    "GB200": 8000,
    "B200": 8000,
    "RTX PRO 6000": 1792,
    "RTX 5090": 1792,
    "A100": 2039,
    "L40S": 864,
}

V_DIM, ROPE_DIM, PAGE = 512, 64, 64
D = V_DIM + ROPE_DIM


def nominal_gbps(name: str) -> float | None:
    hits = [k for k in NOMINAL_GBPS if k in name]
    return float(NOMINAL_GBPS[max(hits, key=len)]) if hits else None


def timer(device: torch.device):
    """fn -> median seconds per call."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=10, rep=40, return_mode="median") / 1e3

    def cpu_time(fn, reps: int = 5) -> float:
        fn()
        samples = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    return cpu_time


def copy_gbps(device: torch.device, time_it) -> float:
    """A device-to-device copy's bytes read + written per second: the practical bandwidth."""
    n = (1 << 30) if device.type == "cuda" else (1 << 26)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / time_it(lambda: dst.copy_(src)) / 1e9


def bench_mla_decode(ops_list, device, batches, contexts, heads_list, time_it, peak, copy_peak, ref_max_tokens):
    """Rows of {batch, context, heads, <backend>_us, <backend>_gbps, <backend>_pct_nominal...}."""
    gen = torch.Generator(device=device).manual_seed(0)
    num_pages = max(batches) * max(contexts) // PAGE
    pool = torch.empty(num_pages, 2, PAGE, D, dtype=torch.bfloat16, device=device)
    pool.normal_(generator=gen)
    kv = pool[:, 1]  # one layer of a page-major pool, as the engine passes it
    rows = []
    for heads in heads_list:
        for batch in batches:
            for context in contexts:
                pages = context // PAGE
                table = (
                    torch.randperm(num_pages, device=device, generator=gen)[: batch * pages].view(batch, pages).int()
                )
                lens = torch.full((batch,), context, dtype=torch.int32, device=device)
                q = torch.randn(batch, heads, D, dtype=torch.bfloat16, device=device, generator=gen)
                nbytes = batch * context * D * 2 + q.numel() * 2 + batch * heads * V_DIM * 2
                row = {"batch": batch, "context": context, "heads": heads, "bytes": nbytes}
                for name, ops in ops_list:
                    if name == "torch" and batch * context > ref_max_tokens:
                        continue
                    seconds = time_it(lambda: ops.mla_decode(q, kv, table, lens, D**-0.5, V_DIM))
                    row[f"{name}_us"] = round(seconds * 1e6, 2)
                    row[f"{name}_gbps"] = round(nbytes / seconds / 1e9, 1)
                    if peak:
                        row[f"{name}_pct_nominal"] = round(100 * nbytes / seconds / 1e9 / peak, 1)
                    row[f"{name}_pct_copy"] = round(100 * nbytes / seconds / 1e9 / copy_peak, 1)
                if "triton_us" in row and "torch_us" in row:
                    row["speedup_vs_torch"] = round(row["torch_us"] / row["triton_us"], 2)
                rows.append(row)
                print("mla_decode", json.dumps(row), flush=True)
    del pool
    return rows


def mla_decode_tuning(device, time_it, peak, batch=64, context=4096, heads=16):
    """Split counts and tile shapes at the acceptance point, to see what the default leaves."""
    from dsv4_kernels import triton_ops
    from dsv4_kernels.triton_kernels.mla_decode import DecodeConfig

    gen = torch.Generator(device=device).manual_seed(1)
    pages = context // PAGE
    pool = torch.empty(batch * pages, 2, PAGE, D, dtype=torch.bfloat16, device=device)
    pool.normal_(generator=gen)
    kv = pool[:, 0]
    table = torch.randperm(batch * pages, device=device, generator=gen).view(batch, pages).int()
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, D, dtype=torch.bfloat16, device=device, generator=gen)
    nbytes = batch * context * D * 2 + q.numel() * 2 + batch * heads * V_DIM * 2
    want = reference.mla_decode(q, kv, table, lens, D**-0.5, V_DIM).float()
    configs = [
        None,
        DecodeConfig(16, 16, 4, 2),
        DecodeConfig(16, 32, 4, 3),
        DecodeConfig(16, 64, 8, 2),
        DecodeConfig(32, 32, 8, 2),
    ]
    rows = []
    for cfg in configs:
        for splits in (None, 1, 2, 4, 8, 16):
            try:
                run = lambda: triton_ops.mla_decode(q, kv, table, lens, D**-0.5, V_DIM, num_splits=splits, config=cfg)
                err = (run().float() - want).abs().max().item()
                seconds = time_it(run)
            except Exception as exc:  # a tile that does not fit this card: record, keep going
                rows.append({"config": str(cfg), "num_splits": splits, "error": f"{type(exc).__name__}: {exc}"[:200]})
                continue
            gbps = nbytes / seconds / 1e9
            rows.append(
                {
                    "config": "default" if cfg is None else str(cfg),
                    "num_splits": splits or "default",
                    "us": round(seconds * 1e6, 2),
                    "gbps": round(gbps, 1),
                    "pct_nominal": round(100 * gbps / peak, 1) if peak else None,
                    "max_abs_err": err,
                }
            )
            print("mla_decode_tuning", json.dumps(rows[-1]), flush=True)
    del pool
    return rows


def v4_decode_case(device, batch, context, kind, heads=64, hd=512, window=128, top_k=512, dtype=torch.bfloat16, seed=3):
    """One decode step of one V4 attention layer in the engine's layout: a ring row per request,
    compressed entries paged (page 64) in shuffled pages, CSA picks drawn from the visible
    entries. Returns (args for v4_attention_decode, bytes the kernel must read and write)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rate = {"csa": 4, "hca": 128, "swa": 1}[kind]
    count = context // rate
    epp = max(1, PAGE // rate)
    pages = -(-context // PAGE)
    q = torch.randn(batch, heads, hd, dtype=dtype, device=device, generator=gen)
    kv = torch.randn(batch, hd, dtype=dtype, device=device, generator=gen)
    ring = torch.randn(batch, window, hd, dtype=dtype, device=device, generator=gen)
    store = torch.randn(batch * pages, epp, hd, dtype=dtype, device=device, generator=gen) if kind != "swa" else None
    table = torch.randperm(batch * pages, device=device, generator=gen).view(batch, pages).int()
    comp_idx = None
    picked = count if kind == "hca" else 0
    if kind == "csa":
        picked = min(top_k, count)
        comp_idx = torch.rand(batch, count, device=device, generator=gen).argsort(dim=1)[:, :picked].int()
    args = dict(
        q=q,
        kv=kv,
        ring=ring,
        slot_ids=torch.arange(batch, device=device),
        positions=torch.full((batch,), context - 1, device=device),
        block_table=table,
        comp_kv=store,
        comp_idx=comp_idx,
        sink=torch.randn(heads, device=device, generator=gen),
        sm_scale=hd**-0.5,
        rate=rate,
        page_size=PAGE,
    )
    keys = min(window, context) + picked
    el = q.element_size()
    nbytes = batch * (keys * hd * el + 2 * heads * hd * el + (picked * 4 if comp_idx is not None else 0))
    return args, nbytes


def bench_v4_decode(ops_list, device, batches, contexts, kinds, time_it, peak, copy_peak, heads, hd, top_k, dtype):
    """V4 decode attention per layer type: achieved GB/s of the keys it must read (window +
    CSA picks or every HCA entry) plus q and out, and the share of the card's bandwidth."""
    from dsv4_kernels import reference_v4

    rows = []
    for kind in kinds:
        for batch in batches:
            for context in contexts:
                args, nbytes = v4_decode_case(
                    device, batch, context, kind, heads=heads, hd=hd, top_k=top_k, dtype=dtype
                )
                row = {
                    "kind": kind,
                    "batch": batch,
                    "context": context,
                    "heads": heads,
                    "head_dim": hd,
                    "bytes": nbytes,
                }
                want = None
                for name, ops in ops_list:
                    fn = getattr(ops, "v4_attention_decode", None) or reference_v4.v4_attention_decode
                    out = fn(**args)
                    if want is None:
                        want = out.float()
                    else:
                        err = (out.float() - want).abs().max().item()
                        row[f"{name}_max_abs_err_vs_{ops_list[0][0]}"] = round(err, 5)
                    seconds = time_it(lambda fn=fn: fn(**args))
                    row[f"{name}_us"] = round(seconds * 1e6, 2)
                    row[f"{name}_gbps"] = round(nbytes / seconds / 1e9, 1)
                    if peak:
                        row[f"{name}_pct_nominal"] = round(100 * nbytes / seconds / 1e9 / peak, 1)
                    row[f"{name}_pct_copy"] = round(100 * nbytes / seconds / 1e9 / copy_peak, 1)
                if "triton_us" in row and "torch_us" in row:
                    row["speedup_vs_torch"] = round(row["torch_us"] / row["triton_us"], 2)
                rows.append(row)
                print("v4_attention_decode", json.dumps(row), flush=True)
    return rows


def bench_v4_indexer(ops_list, device, batches, contexts, time_it, heads, dim, top_k, dtype):
    """Lightning indexer at decode: one query per request over its context // 4 keys."""
    from dsv4_kernels import reference_v4

    rows = []
    for batch in batches:
        for context in contexts:
            gen = torch.Generator(device=device).manual_seed(4)
            count = context // 4
            pages = -(-context // PAGE)
            iq = torch.randn(batch, heads, dim, dtype=dtype, device=device, generator=gen)
            iw = torch.randn(batch, heads, device=device, generator=gen) * heads**-0.5
            store = torch.randn(batch * pages, PAGE // 4, dim, dtype=dtype, device=device, generator=gen)
            table = torch.randperm(batch * pages, device=device, generator=gen).view(batch, pages).int()
            args = dict(
                iq=iq,
                iw=iw,
                index_k=store,
                block_table=table,
                positions=torch.full((batch,), context - 1, device=device),
                extend_lens=torch.ones(batch, dtype=torch.long, device=device),
                top_k=top_k,
                scale=dim**-0.5,
                rate=4,
                page_size=PAGE,
            )
            row = {
                "batch": batch,
                "context": context,
                "heads": heads,
                "dim": dim,
                "top_k": top_k,
                "key_bytes": batch * count * dim * iq.element_size(),
            }
            for name, ops in ops_list:
                fn = getattr(ops, "v4_indexer_topk", None) or reference_v4.v4_indexer_topk
                seconds = time_it(lambda fn=fn: fn(**args))
                row[f"{name}_us"] = round(seconds * 1e6, 2)
                row[f"{name}_key_gbps"] = round(row["key_bytes"] / seconds / 1e9, 1)
            rows.append(row)
            print("v4_indexer_topk", json.dumps(row), flush=True)
    return rows


def torch_bf16_experts(x, w13, w2, weights, ids):
    """What a plain torch MoE does (HF's loop): per-expert matmuls in the weights' dtype."""
    out = torch.zeros_like(x)
    inter = w13.shape[1] // 2
    for expert in ids.unique().tolist():
        token, slot = torch.where(ids == expert)
        gate, up = F.linear(x[token], w13[expert]).split(inter, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]) * weights[token, slot, None].to(x.dtype)
        out.index_add_(0, token, y)
    return out


def bench_moe(ops_list, device, token_counts, experts, hidden, inter, top_k, dtype, time_it):
    gen = torch.Generator(device=device).manual_seed(2)
    w13 = torch.randn(experts, 2 * inter, hidden, dtype=dtype, device=device, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, dtype=dtype, device=device, generator=gen) * inter**-0.5
    bias = torch.zeros(experts, device=device)
    n_group = 8 if experts % 8 == 0 and experts >= 16 else 1
    rows = []
    for tokens in token_counts:
        x = torch.randn(tokens, hidden, dtype=dtype, device=device, generator=gen)
        logits = torch.randn(tokens, experts, device=device, generator=gen)
        weights, ids = reference.moe_route(logits, bias, n_group, min(4, n_group), top_k, True, 2.5)
        flops = 6 * tokens * top_k * hidden * inter
        weight_bytes = ids.unique().numel() * 3 * hidden * inter * w13.element_size()
        row = {"tokens": tokens, "experts": experts, "hidden": hidden, "inter": inter, "top_k": top_k, "flops": flops}
        runs = [(name, lambda ops=ops: ops.moe_experts(x, w13, w2, weights, ids)) for name, ops in ops_list]
        runs.append(("torch_loop", lambda: torch_bf16_experts(x, w13, w2, weights, ids)))
        for name, fn in runs:
            seconds = time_it(fn)
            row[f"{name}_us"] = round(seconds * 1e6, 2)
            row[f"{name}_tflops"] = round(flops / seconds / 1e12, 3)
            row[f"{name}_weight_gbps"] = round(weight_bytes / seconds / 1e9, 1)
        if "triton_us" in row:
            row["speedup_vs_torch"] = round(row["torch_us"] / row["triton_us"], 2)
            row["speedup_vs_torch_loop"] = round(row["torch_loop_us"] / row["triton_us"], 2)
        rows.append(row)
        print("moe_experts", json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="dsv4 kernel benchmarks")
    parser.add_argument("--cpu", action="store_true", help="benchmark the torch reference on CPU (no GPU needed)")
    parser.add_argument("--quick", action="store_true", help="a few small shapes (smoke test)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/kernels_bench.json"))
    parser.add_argument(
        "--only",
        choices=["all", "v4", "v3"],
        default="all",
        help="v4: only the DeepSeek-V4 kernels (decode attention, indexer); v3: only mla_decode and MoE",
    )
    args = parser.parse_args(argv)

    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device: pass --cpu to benchmark the torch backend on CPU")
    device = torch.device("cpu" if args.cpu else "cuda")
    time_it = timer(device)
    started = time.time()

    if device.type == "cuda":
        from dsv4_kernels import triton_ops

        name = torch.cuda.get_device_name()
        ops_list = [("triton", triton_ops), ("torch", reference)]
        meta = {
            "device": name,
            "capability": list(torch.cuda.get_device_capability()),
            "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        }
        import triton

        meta["triton"] = triton.__version__
    else:
        name = platform.processor() or platform.machine()
        ops_list = [("torch", reference)]
        meta = {"device": f"cpu ({name})", "threads": torch.get_num_threads()}
    meta.update(torch=torch.__version__, quick=args.quick)
    peak = nominal_gbps(name) if device.type == "cuda" else None
    copy_peak = copy_gbps(device, time_it)
    meta.update(nominal_gbps=peak, copy_gbps=round(copy_peak, 1))
    print("meta", json.dumps(meta), flush=True)

    v4_decode, v4_indexer = [], []
    if args.only == "v3":
        pass
    elif device.type == "cuda":
        v4_batches = [1, 8, 64] if args.quick else [1, 8, 32, 64, 128]
        v4_contexts = [4096] if args.quick else [1024, 4096, 16384, 65536]
        v4_decode = bench_v4_decode(
            ops_list,
            device,
            v4_batches,
            v4_contexts,
            ["csa", "hca", "swa"],
            time_it,
            peak,
            copy_peak,
            heads=64,
            hd=512,
            top_k=512,
            dtype=torch.bfloat16,
        )
        v4_indexer = bench_v4_indexer(
            ops_list, device, v4_batches, v4_contexts, time_it, heads=64, dim=128, top_k=512, dtype=torch.bfloat16
        )
    else:
        v4_decode = bench_v4_decode(
            ops_list,
            device,
            [1, 8],
            [1024] if args.quick else [1024, 4096],
            ["csa", "hca"],
            time_it,
            None,
            copy_peak,
            heads=16 if args.quick else 64,
            hd=512,
            top_k=64 if args.quick else 512,
            dtype=torch.float32,
        )
        v4_indexer = bench_v4_indexer(
            ops_list,
            device,
            [1, 8],
            [1024] if args.quick else [1024, 4096],
            time_it,
            heads=16 if args.quick else 64,
            dim=128,
            top_k=64 if args.quick else 512,
            dtype=torch.float32,
        )
    if args.only == "v4":
        decode, tuning, moe = [], [], []
    elif device.type == "cuda":
        batches = [1, 8, 64] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128]
        contexts = [1024, 4096] if args.quick else [1024, 2048, 4096, 8192, 16384, 32768]
        decode = bench_mla_decode(
            ops_list, device, batches, contexts, [16], time_it, peak, copy_peak, ref_max_tokens=256 * 1024
        )
        if not args.quick:  # 128 heads (no tensor parallelism): a shorter sweep
            decode += bench_mla_decode(
                ops_list, device, [1, 16, 64, 128], [4096, 32768], [128], time_it, peak, copy_peak, 256 * 1024
            )
        tuning = mla_decode_tuning(device, time_it, peak) if not args.quick else []
        free, _ = torch.cuda.mem_get_info()
        experts = 256 if free > 40e9 else 64
        tokens = [1, 8, 64, 512] if args.quick else [1, 8, 32, 128, 512, 2048, 8192]
        moe = bench_moe(ops_list, device, tokens, experts, 7168, 2048, 8, torch.bfloat16, time_it)
    else:
        batches = [1, 8] if args.quick else [1, 8, 32]
        contexts = [256, 1024] if args.quick else [256, 1024, 4096]
        decode = bench_mla_decode(
            ops_list, device, batches, contexts, [16], time_it, None, copy_peak, ref_max_tokens=1 << 30
        )
        tuning = []
        tokens = [1, 64] if args.quick else [1, 16, 256, 1024]
        moe = bench_moe(
            ops_list,
            device,
            tokens,
            8 if args.quick else 64,
            256 if args.quick else 1024,
            128 if args.quick else 512,
            2 if args.quick else 8,
            torch.float32,
            time_it,
        )

    summary = {}
    target = [r for r in decode if r["batch"] == 64 and r["context"] == 4096 and r["heads"] == 16]
    if target and "triton_pct_nominal" in target[0]:
        summary["mla_decode_b64_c4k_pct_nominal"] = target[0]["triton_pct_nominal"]
        summary["mla_decode_b64_c4k_meets_70pct"] = target[0]["triton_pct_nominal"] >= 70.0
    best_moe = max((r.get("triton_tflops", r.get("torch_tflops", 0)) for r in moe), default=0)
    summary["moe_best_tflops"] = best_moe
    for kind in ("csa", "hca", "swa"):
        hit = [r for r in v4_decode if r["kind"] == kind and r["batch"] == 64 and r["context"] == 4096]
        if hit and "triton_pct_nominal" in hit[0]:
            summary[f"v4_decode_{kind}_b64_c4k_pct_nominal"] = hit[0]["triton_pct_nominal"]
    if "v4_decode_csa_b64_c4k_pct_nominal" in summary:
        summary["v4_decode_csa_b64_c4k_meets_70pct"] = summary["v4_decode_csa_b64_c4k_pct_nominal"] >= 70.0
    summary["seconds"] = round(time.time() - started, 1)
    result = {
        "meta": meta,
        "summary": summary,
        "mla_decode": decode,
        "mla_decode_tuning": tuning,
        "moe_experts": moe,
        "v4_attention_decode": v4_decode,
        "v4_indexer_topk": v4_indexer,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print("summary", json.dumps(summary), flush=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
