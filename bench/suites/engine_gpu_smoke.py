"""The engine on a GPU, in process, for bench/gpu_kernels.sh: bf16, the Triton backend, decode
CUDA graphs off and on. Checks and measures, and writes one JSON:

  - seeded sampling: two requests with the same prompt and seed (temperature 0.8) get the same
    tokens, in one batch with others (a CPU generator with CUDA logits used to fail them all);
  - greedy tokens with graphs on equal those with graphs off (share of equal tokens reported:
    bf16 may flip near-ties when a padded bucket picks another MoE tile);
  - inter-token latency: mean wall time of an all-decode step at batch 1, 8 and 32 (128-token
    prompts, 64 new tokens), with and without graphs.

    python -m bench.suites.engine_gpu_smoke [--model DIR] [--out bench/results/engine_gpu_smoke.json]

With no --model it writes a preset (--preset, default mla512; bench/gpu_kernels.sh runs v4-tiny too)
to a temporary folder. --device cuda:1 runs it off GPU 0 (every thread must choose its device);
--tp 2 spans two GPUs, graphs captured on both ranks (with --dp 2: data-parallel attention, each
rank its own graphs of its own requests' steps). CPU: --device cpu --quick
runs the same code without graphs (what the smoke test does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence


def drive(engine: Engine, seqs: list[Sequence], timeout: float = 300) -> list[float]:
    """Run the engine step by step until every request finishes; the wall time of each step
    whose batch was all decodes."""
    for s in seqs:
        engine.submit(s)
    decode_steps: list[float] = []
    deadline = time.monotonic() + timeout
    while any(not s.finished for s in seqs):
        if time.monotonic() > deadline:
            raise TimeoutError("engine did not finish the smoke's requests")
        running = list(engine.scheduler.running)
        all_decode = (
            bool(running) and not engine.scheduler.waiting and all(s.num_computed == s.num_tokens - 1 for s in running)
        )
        t0 = time.perf_counter()
        engine.step()
        if all_decode:
            decode_steps.append(time.perf_counter() - t0)
    return decode_steps


def run(
    model: str,
    device: str,
    dtype: str,
    backend: str,
    graphs: int,
    batches: list[int],
    new: int,
    prompt_len: int,
    tp: int = 1,
    dp: int = 1,
) -> dict:
    t0 = time.perf_counter()
    engine = Engine(
        EngineArgs(
            model=model,
            dtype=dtype,
            device=device,
            kernel_backend=backend,
            cuda_graph_max_bs=graphs,
            kv_memory_gb=2.0,
            page_size=16,
            max_num_seqs=max(batches) + 4,
            max_num_batched_tokens=max(4096, prompt_len * 4),
            tp_size=tp,
            dp_size=dp,
        )
    )
    vocab = engine.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    # graphs_active: the buckets were all captured at start-up (0: off, or the capture failed).
    out: dict = {
        "graphs": graphs,
        "graphs_active": engine.runner.cuda_graph_max_bs,
        "tp": tp,
        "dp": dp,
        "device": str(engine.runner.device),
        "start_s": round(time.perf_counter() - t0, 2),
    }
    # Seeded sampling, alongside greedy and unseeded requests in one batch.
    prompt = torch.randint(2, vocab, (prompt_len,), generator=g).tolist()
    seeded = [
        Sequence(f"seed{i}", prompt, SamplingParams(max_tokens=16, temperature=0.8, seed=1234, ignore_eos=True))
        for i in range(2)
    ]
    others = [
        Sequence("greedy", prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)),
        Sequence("unseeded", prompt, SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, ignore_eos=True)),
    ]
    drive(engine, seeded + others)
    out["sampling_errors"] = [s.error for s in seeded + others if s.error]
    out["seeded_equal"] = seeded[0].output_ids == seeded[1].output_ids and len(seeded[0].output_ids) == 16
    out["greedy_tokens"] = others[0].output_ids
    out["itl_ms"] = {}
    for b in batches:
        seqs = [
            Sequence(
                f"b{b}-{i}",
                torch.randint(2, vocab, (prompt_len,), generator=g).tolist(),
                SamplingParams(max_tokens=new, temperature=0, ignore_eos=True),
            )
            for i in range(b)
        ]
        steps = drive(engine, seqs)
        steps = steps[2:] or steps  # the first decode steps may capture graphs / compile kernels
        out["itl_ms"][str(b)] = round(statistics.median(steps) * 1e3, 3) if steps else None
    engine.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--preset", default="mla512", help="preset written when no --model is given (e.g. v4-tiny)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backend", default="triton")
    p.add_argument("--graphs", type=int, default=32, help="--cuda-graph-max-bs of the 'on' run")
    p.add_argument("--tp", type=int, default=1, help="--tp-size (one GPU a rank, from --device's index)")
    p.add_argument("--dp", type=int, default=1, help="--dp-size (data-parallel attention; with --tp equal to it)")
    p.add_argument("--quick", action="store_true", help="batch 1 and 2, 4 new tokens (CPU smoke)")
    p.add_argument("--out", type=Path, default=Path("bench/results/engine_gpu_smoke.json"))
    a = p.parse_args()
    model = a.model
    if model is None:
        from dsv4_engine.checkpoint import init_checkpoint

        model = str(init_checkpoint(Path(tempfile.mkdtemp()) / a.preset, preset=a.preset, seed=0))
    batches, new, prompt_len = ([1, 2], 4, 16) if a.quick else ([1, 8, 32], 64, 128)
    graph_sides = [0] if a.device == "cpu" else [0, a.graphs]
    result = {
        "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
        "dtype": a.dtype,
        "backend": a.backend,
        "tp": a.tp,
        "dp": a.dp,
        "runs": [],
    }
    for graphs in graph_sides:
        result["runs"].append(run(model, a.device, a.dtype, a.backend, graphs, batches, new, prompt_len, a.tp, a.dp))
    runs = result["runs"]
    if len(runs) == 2:
        x, y = runs[0]["greedy_tokens"], runs[1]["greedy_tokens"]
        result["greedy_equal_share"] = sum(i == j for i, j in zip(x, y)) / max(1, len(x))
        result["itl_speedup_with_graphs"] = {
            b: (
                round(runs[0]["itl_ms"][b] / runs[1]["itl_ms"][b], 2)
                if runs[0]["itl_ms"][b] and runs[1]["itl_ms"][b]
                else None
            )
            for b in runs[0]["itl_ms"]
        }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    ok = all(not r["sampling_errors"] and r["seeded_equal"] for r in runs)
    # Asked for graphs on a GPU: they must all have been captured (a failed capture is one log line).
    ok = ok and all(r["graphs_active"] == r["graphs"] for r in runs if a.device != "cpu")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
