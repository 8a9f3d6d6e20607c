"""The engine's start-up and step on a real GPU, as bench/gpu_kernels.sh (PARTS=engine) runs
them: one line per check, `CHECK <name>: PASS|FAIL <figures>`, and one JSON.

  - default_kv_sizing: an engine with no memory flags sizes its pool from the device's free
    memory (`--kv-memory-fraction`, a graph reserve), graphs on by default, and free memory
    is left after capture (the measured graph pool next to the reserve it was given);
  - greedy_graphs_fp32: greedy tokens with decode graphs on equal those with graphs off, token
    for token, in float32 (a short and a long context in one batch: the block table's used
    width changes from step to step; the long prompt's chunks share mixed steps with the
    others' decodes, whose rows replay the graphs on V4);
  - greedy_graphs_bf16: the same in bfloat16, where a padded bucket may flip a near-tie: the
    share of equal tokens must be at least 0.9;
  - dead_device: an out-of-bounds index on the device inside a step (a device-side assert, in a
    child process) fails the engine: `Engine.failed` set, the requests failed, the loop stopped.

    python -m bench.suites.engine_gpu_checks [--preset v4-tiny] [--out bench/results/engine_gpu_checks.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.kv_cache import page_nbytes
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence

GIB = 1 << 30


def line(name: str, ok: bool, detail: str) -> bool:
    print(f"CHECK {name}: {'PASS' if ok else 'FAIL'} {detail}", flush=True)
    return ok


def drive(engine: Engine, seqs: list[Sequence], timeout: float = 240) -> None:
    for s in seqs:
        engine.submit(s)
    deadline = time.monotonic() + timeout
    while any(not s.finished for s in seqs):
        if time.monotonic() > deadline:
            raise TimeoutError("the engine did not finish the check's requests")
        engine.step()


def greedy(model: str, dtype: str, graphs: int, prompts: list[list[int]], new: int) -> tuple[list[list[int]], dict]:
    engine = Engine(
        EngineArgs(
            model=model,
            dtype=dtype,
            device="cuda",
            cuda_graph_max_bs=graphs,
            kv_memory_gb=1.0,
            max_num_seqs=8,
            max_num_batched_tokens=256,  # the long prompt's chunks share steps with the others' decodes
        )
    )
    seqs = [
        Sequence(f"g{i}", p, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    drive(engine, seqs)
    status = engine.runner.graphs_status()
    engine.stop()
    return [s.output_ids for s in seqs], status


def check_default_sizing(model: str) -> tuple[bool, dict]:
    free_before, total = torch.cuda.mem_get_info()
    engine = Engine(EngineArgs(model=model, device="cuda"))  # no memory flags, graphs by default
    free_after, _ = torch.cuda.mem_get_info()
    size = engine.pool_size
    graphs = engine.runner.graphs_status()
    pool_bytes = size.num_pages * page_nbytes(engine.runner.state_specs, engine.pool.page_size, engine.runner.dtype)
    graph_pool = engine.runner.graphs.pool if engine.runner.graphs is not None else None
    out = {
        "free_before_gib": round(free_before / GIB, 2),
        "free_after_start_gib": round(free_after / GIB, 2),
        "total_gib": round(total / GIB, 2),
        "budget_gib": round(size.budget.nbytes / GIB, 2),
        "source": size.budget.source,
        "num_pages": size.num_pages,
        "num_snapshots": size.num_snapshots,
        "pool_gib": round(pool_bytes / GIB, 2),
        "graphs": graphs,
        "torch_reserved_gib": round(torch.cuda.memory_reserved() / GIB, 2),  # pool + graphs + weights
    }
    engine.stop()
    del engine  # its pool takes most of the device: give it back before the next check
    gc.collect()
    torch.cuda.empty_cache()
    ok = "--kv-memory-fraction" in size.budget.source and graphs["enabled"] and free_after > 0.25 * GIB
    ok = ok and graph_pool is not None
    line(
        "default_kv_sizing",
        ok,
        f"{size.num_pages} pages ({out['pool_gib']} GiB of {out['budget_gib']} GiB budget), "
        f"{out['free_after_start_gib']} GiB free after start, graphs {graphs['batch_sizes'] or graphs['eager_reason']}",
    )
    return ok, out


DEAD_DEVICE = textwrap.dedent(
    """
    import sys, torch
    from dsv4_engine.engine import Engine
    from dsv4_engine.engine_args import EngineArgs
    from dsv4_engine.sampling_params import SamplingParams
    from dsv4_engine.sequence import Sequence
    e = Engine(EngineArgs(model=sys.argv[1], device="cuda", cuda_graph_max_bs=0, kv_memory_gb=0.5, max_num_seqs=4))
    def bad(*a, **k):  # what a kernel reading out of bounds does to the context
        x = torch.zeros(4, device="cuda")
        return x[torch.tensor([1 << 20], device="cuda")].sum().item()
    e.runner.forward = bad
    outs = []
    e.submit(Sequence("a", [5, 6, 7], SamplingParams(max_tokens=2), sink=outs.append))
    for _ in range(5):
        e.step()
        if e.failed:
            break
    print("FAILED=" + str(e.failed), flush=True)
    print("ERROR=" + str(outs[-1].error if outs else None), flush=True)
    """
)


def check_dead_device(model: str) -> tuple[bool, dict]:
    p = subprocess.run(
        [sys.executable, "-c", DEAD_DEVICE, model], capture_output=True, text=True, timeout=150, env=None
    )
    failed = next((x[7:] for x in p.stdout.splitlines() if x.startswith("FAILED=")), "None")
    ok = failed.startswith("device failed:")
    line("dead_device", ok, failed if ok else (p.stdout + p.stderr)[-400:])
    return ok, {"failed": failed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--preset", default="v4-tiny")
    p.add_argument("--out", type=Path, default=Path("bench/results/engine_gpu_checks.json"))
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("engine_gpu_checks needs a CUDA device")
    model = a.model
    if model is None:
        from dsv4_engine.checkpoint import init_checkpoint

        model = str(init_checkpoint(Path(tempfile.mkdtemp()) / a.preset, preset=a.preset, seed=0))
    result: dict = {"device": torch.cuda.get_device_name(), "preset": a.preset, "checks": {}}
    oks = []
    g = torch.Generator().manual_seed(0)
    config = json.loads((Path(model) / "config.json").read_text())
    long_len = min(900, config.get("max_position_embeddings", 1024) - 80)
    prompts = [torch.randint(2, config["vocab_size"], (n,), generator=g).tolist() for n in (16, 40, long_len)]
    for dtype, exact in (("float32", True), ("bfloat16", False)):
        off, _ = greedy(model, dtype, 0, prompts, 48)
        on, status = greedy(model, dtype, 8, prompts, 48)
        pairs = [(x, y) for a_, b_ in zip(off, on) for x, y in zip(a_, b_)]
        share = sum(x == y for x, y in pairs) / max(1, len(pairs))
        ok = status["enabled"] and (off == on if exact else share >= 0.9)
        name = f"greedy_graphs_{'fp32' if exact else 'bf16'}"
        result["checks"][name] = {"equal_share": share, "graphs": status}
        oks.append(line(name, ok, f"equal share {share:.3f} over {len(pairs)} tokens, graphs {status['batch_sizes']}"))
    gc.collect()
    torch.cuda.empty_cache()
    ok, result["checks"]["default_kv_sizing"] = check_default_sizing(model)  # last in process: it takes the device
    oks.append(ok)
    ok, result["checks"]["dead_device"] = check_dead_device(model)
    oks.append(ok)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"engine_gpu_checks: {sum(oks)}/{len(oks)} passed", flush=True)
    sys.exit(0 if all(oks) else 1)


if __name__ == "__main__":
    main()
