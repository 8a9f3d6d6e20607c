"""NIXL KV-page transfer throughput between two processes vs an in-process copy of the same pages.

The writer (this process) moves `--mib` MiB per transfer from its KV pool into a peer process's
pool through KVTransferAgent.write_pages (NIXL, UCX, no progress thread), with pages scattered
at random on both sides as in a fragmented KV pool. Baselines, in this process, on the same
pools and the same page mapping:
  memcpy       one contiguous copy_ of the same number of bytes (plain memory bandwidth)
  paged copy   dst.index_copy_(0, dst_idx, src.index_select(0, src_idx)) (torch, page by page)
Each figure is the best of `--repeats` timed runs. Target: NIXL >= 50% of memcpy at 64 KiB.

    python -m bench.suites.nixl_pages [--sizes 4096,65536,262144] [--mib 32] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from bench import RESULTS

ROW_WIDTH = 256  # elements per page row; a page is [1, rows, ROW_WIDTH]
TARGET_PAGE_BYTES = 65536
TARGET_RATIO = 0.5


def page_shape(page_bytes: int, element_size: int) -> tuple[int, int, int]:
    rows, rest = divmod(page_bytes, element_size * ROW_WIDTH)
    if rest or rows == 0:
        raise SystemExit(f"page size {page_bytes} B is not a multiple of {element_size * ROW_WIDTH} B")
    return (1, rows, ROW_WIDTH)


def peer_main(conn, name: str, shape: tuple, dtype: str, device: str) -> None:
    """The receiving engine: registers its pool and polls notifications until told to stop."""
    from dsv4_engine.pd.nixl.agent import KVTransferAgent

    agent = KVTransferAgent(name, torch.zeros(shape, dtype=getattr(torch, dtype), device=device))
    conn.send(agent.descriptor())
    received = 0
    while True:
        received += len(agent.poll_notifs())
        if not conn.poll(0.0002):
            continue
        cmd, *args = conn.recv()
        if cmd == "count":
            conn.send(received)
        elif cmd == "pages":
            idx = torch.tensor(args[0], device=device)
            conn.send(agent._pool[idx].cpu().contiguous().view(torch.uint8).numpy().tobytes())
        elif cmd == "exit":
            agent.close()
            conn.send(True)
            return


def bench_size(page_bytes: int, args, ctx) -> dict:
    from dsv4_engine.pd.nixl.agent import KVTransferAgent
    from dsv4_engine.pd.transport import TransferState

    dtype = getattr(torch, args.dtype)
    shape_page = page_shape(page_bytes, dtype.itemsize)
    per_xfer = (args.mib << 20) // page_bytes
    num_pages = 2 * per_xfer  # pool twice the transfer: the pages land scattered
    shape = (num_pages, *shape_page)
    g = torch.Generator().manual_seed(page_bytes)
    src_pool = torch.randn(shape, generator=g).to(dtype).to(args.device)
    src_idx = torch.randperm(num_pages, generator=g)[:per_xfer]
    dst_idx = torch.randperm(num_pages, generator=g)[:per_xfer]
    src_list, dst_list = src_idx.tolist(), dst_idx.tolist()
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    dst_pool = torch.zeros_like(src_pool)  # the in-process baselines' destination
    flat_src, flat_dst = src_pool.view(num_pages, -1), dst_pool.view(num_pages, -1)
    src_dev, dst_dev = src_idx.to(args.device), dst_idx.to(args.device)

    def memcpy_once() -> None:
        flat_dst[:per_xfer].copy_(flat_src[per_xfer:])
        sync()

    def paged_once() -> None:
        flat_dst.index_copy_(0, dst_dev, flat_src.index_select(0, src_dev))
        sync()

    parent, child = ctx.Pipe()
    peer_name = f"bench-decode-{page_bytes}"
    proc = ctx.Process(target=peer_main, args=(child, peer_name, shape, args.dtype, args.device), daemon=True)
    proc.start()
    try:
        if not parent.poll(120):
            raise SystemExit("peer process did not start")
        desc = parent.recv()
        with KVTransferAgent(f"bench-prefill-{page_bytes}", src_pool) as agent:
            agent.add_peer(desc)
            failures = []

            def nixl_once() -> None:
                h = agent.write_pages(peer_name, src_list, dst_list, b"done")
                state = agent.poll(h)
                while state is TransferState.PENDING:
                    state = agent.poll(h)
                if state is not TransferState.DONE:
                    failures.append(agent.error(h))
                agent.release(h)

            # Interleaved, so that load from elsewhere on the machine hits all three alike.
            times: dict[str, list[float]] = {"nixl": [], "memcpy": [], "paged": []}
            for i in range(args.warmup + args.repeats):  # the warm-up includes connection setup
                for key, fn in (("nixl", nixl_once), ("memcpy", memcpy_once), ("paged", paged_once)):
                    t0 = time.perf_counter()
                    fn()
                    if i >= args.warmup:
                        times[key].append(time.perf_counter() - t0)
            if failures:
                raise SystemExit(f"NIXL transfers failed: {failures[:3]}")
            # Every notification arrived, and the last transfer's bytes are exact.
            expected = args.warmup + args.repeats
            deadline = time.monotonic() + 30
            received = 0
            while received < expected and time.monotonic() < deadline:
                parent.send(("count",))
                received = parent.recv()
            parent.send(("pages", dst_list))
            landed = parent.recv()
            exact = landed == src_pool[src_idx.to(args.device)].cpu().contiguous().view(torch.uint8).numpy().tobytes()
        parent.send(("exit",))
        parent.poll(10) and parent.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()

    nixl_best, nixl_median = min(times["nixl"]), statistics.median(times["nixl"])
    memcpy_best, paged_best = min(times["memcpy"]), min(times["paged"])

    nbytes = per_xfer * page_bytes
    gbps = lambda s: nbytes / s / 1e9  # noqa: E731
    row = {
        "page_bytes": page_bytes,
        "pages_per_transfer": per_xfer,
        "bytes_per_transfer": nbytes,
        "nixl_best_s": nixl_best,
        "nixl_median_s": nixl_median,
        "nixl_gbps": gbps(nixl_best),
        "nixl_median_gbps": gbps(nixl_median),
        "memcpy_gbps": gbps(memcpy_best),
        "paged_copy_gbps": gbps(paged_best),
        "ratio_vs_memcpy": memcpy_best / nixl_best,
        "ratio_vs_paged_copy": paged_best / nixl_best,
        "notifications": f"{received}/{expected}",
        "bytes_exact": exact,
    }
    return row


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['page_bytes'] // 1024} KiB" for r in rows]
    xs = range(len(rows))
    width = 0.27
    fig, ax = plt.subplots(figsize=(7, 4))
    series = (
        ("nixl_gbps", "NIXL write (2 processes)"),
        ("memcpy_gbps", "memcpy (in-process)"),
        ("paged_copy_gbps", "torch paged copy (in-process)"),
    )
    for k, (key, label) in enumerate(series):
        bars = ax.bar([x + (k - 1) * width for x in xs], [r[key] for r in rows], width, label=label)
        if key == "nixl_gbps":
            for bar, r in zip(bars, rows):
                ax.annotate(
                    f"{r['ratio_vs_memcpy']:.0%}",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
    ax.set_xticks(list(xs), labels)
    ax.set_xlabel("KV page size (pages scattered at random on both sides)")
    ax.set_ylabel("GB/s (best of N)")
    ax.set_title("KV page transfer: NIXL vs in-process copy (labels: % of memcpy)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4096,65536,262144", help="page sizes in bytes, comma-separated")
    ap.add_argument("--mib", type=int, default=32, help="MiB moved per transfer")
    ap.add_argument("--repeats", type=int, default=20, help="timed runs; the best counts")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu", help="cpu (DRAM) or cuda[:N] (VRAM)")
    ap.add_argument(
        "--torch-threads", type=int, default=1, help="threads for the in-process copies (NIXL's write is one thread)"
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "nixl_pages.json")
    ap.add_argument("--plot", type=Path, default=RESULTS / "nixl_pages.png")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    ctx = mp.get_context("spawn")

    rows = []
    for size in sizes:
        row = bench_size(size, args, ctx)
        rows.append(row)
        print(
            f"{size // 1024:>4} KiB pages x {row['pages_per_transfer']:>5}: NIXL {row['nixl_gbps']:6.2f} GB/s "
            f"(median {row['nixl_median_gbps']:.2f}) | memcpy {row['memcpy_gbps']:6.2f} GB/s | "
            f"paged copy {row['paged_copy_gbps']:6.2f} GB/s | NIXL/memcpy {row['ratio_vs_memcpy']:.2f} "
            f"NIXL/paged {row['ratio_vs_paged_copy']:.2f} | notifs {row['notifications']} exact={row['bytes_exact']}",
            flush=True,
        )

    target_row = next((r for r in rows if r["page_bytes"] == TARGET_PAGE_BYTES), None)
    report = {
        "benchmark": "nixl_pages",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "machine": platform.machine(),
        },
        "results": rows,
        "target": {
            "page_bytes": TARGET_PAGE_BYTES,
            "min_ratio_vs_memcpy": TARGET_RATIO,
            "ratio": target_row["ratio_vs_memcpy"] if target_row else None,
            "met": bool(target_row and target_row["ratio_vs_memcpy"] >= TARGET_RATIO),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, args.plot)
    print(f"wrote {args.out} and {args.plot}")
    if target_row:
        print(
            f"target: NIXL >= {TARGET_RATIO:.0%} of memcpy at 64 KiB pages -> "
            f"{target_row['ratio_vs_memcpy']:.0%} ({'met' if report['target']['met'] else 'NOT met'})"
        )
    ok = all(r["bytes_exact"] and r["notifications"].split("/")[0] == r["notifications"].split("/")[1] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
