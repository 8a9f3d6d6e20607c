"""MTP graphs at --tp-size 2 on two GPUs, as bench/gpu_kernels.sh (PARTS=multi) runs it: one line,
`CHECK mtp_graphs_tp2: PASS|FAIL <figures>`, and one JSON.

A speculating engine (v4-tiny with its MTP layer, float32, --speculative-num-steps 3) at
--tp-size 2 captures the speculator's verify, draft (and V4 catch-up) graphs on both ranks at
start-up (NCCL all-reduces inside them); greedy tokens for a batch of prompts must equal the same
engine's with graphs off (--cuda-graph-max-bs 0: every step eager), token for token, and rank 0
must have replayed every set (rank 1 replays each of those with it, or the step would hang). The
graphs-on run's drafts are steered (right for the first prompt, every other one right for the
second, wrong for the rest) so that verify accepts and rejects, and accepted drafts make
catch-ups of several positions; greedy tokens do not depend on the drafts.

    python -m bench.suites.mtp_graphs_tp [--preset v4-tiny] [--graphs 8] [--out bench/results/mtp_graphs_tp.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence


def counting(graphs) -> dict:
    """Replays of each of rank 0's graph sets, counted as they run."""
    used: dict = {}
    for g in graphs.sets:
        used[g.name] = 0
        step = g.step
        g.step = lambda hb, step=step, name=g.name: (used.__setitem__(name, used[name] + 1), step(hb))[1]
    return used


def steer(engine: Engine, reference: list[list[int]]) -> None:
    """Set each step's drafts from the reference answers: all right for request m0, every other
    one for m1, none for the rest."""
    spec, original, vocab = engine.spec, engine.spec.lookahead, engine.cfg.vocab_size

    def lookahead(seq) -> int:
        n = original(seq)
        i = int(seq.rid[1:])
        want = reference[i][len(seq.output_ids) :]
        for j in range(n):
            right = want[j] if j < len(want) else 0
            spec.drafts[seq].tokens[j] = right if i == 0 or (i == 1 and j % 2 == 0) else (right + 1) % vocab
        return n

    spec.lookahead = engine.scheduler.lookahead = lookahead


def greedy(
    model: str,
    graphs: int,
    prompts: list[list[int]],
    new: int,
    device: str = "cuda",
    reference: Optional[list[list[int]]] = None,
    timeout: float = 240,
) -> tuple[list, dict]:
    t0 = time.perf_counter()
    engine = Engine(
        EngineArgs(
            model=model,
            dtype="float32",
            device=device,
            tp_size=2,
            cuda_graph_max_bs=graphs,
            kv_memory_gb=1.0,
            max_num_seqs=8,
            speculative_algorithm="mtp",
            speculative_num_steps=3,
        )
    )
    out: dict = {"start_s": round(time.perf_counter() - t0, 2), "graphs": engine.loads()["cuda_graphs"]}
    used = counting(engine.spec.graphs) if engine.spec.graphs is not None else {}
    if reference is not None:
        steer(engine, reference)
    seqs = [
        Sequence(f"m{i}", p, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    try:
        for s in seqs:
            engine.submit(s)
        deadline = time.monotonic() + timeout
        while any(not s.finished for s in seqs):
            if time.monotonic() > deadline:
                raise TimeoutError("the engine did not finish the check's requests")
            engine.step()
        out["replays"] = used
        out["errors"] = [s.error for s in seqs if s.error]
        out["tp_failed"] = engine.tp.failed
        t = engine.metrics.totals
        out["drafts"] = [int(t.get(f"spec_decode_num_{k}_tokens", 0)) for k in ("draft", "accepted")]
    finally:
        engine.stop()
        engine.tp.close()
    return [s.output_ids for s in seqs], out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a checkpoint with an MTP layer (default: --preset, written)")
    p.add_argument("--preset", default="v4-tiny")
    p.add_argument("--graphs", type=int, default=8, help="--cuda-graph-max-bs of the graphs-on run")
    p.add_argument("--out", type=Path, default=Path("bench/results/mtp_graphs_tp.json"))
    p.add_argument("--device", default="cuda", help="cpu: the same run without graphs (a dry run of this script)")
    a = p.parse_args()
    if a.device.startswith("cuda") and torch.cuda.device_count() < 2:
        sys.exit("mtp_graphs_tp needs two CUDA devices")
    model = a.model
    if model is None:
        from dsv4_engine.checkpoint import init_checkpoint

        model = str(init_checkpoint(Path(tempfile.mkdtemp()) / a.preset, preset=a.preset, seed=0, mtp=True))
    g = torch.Generator().manual_seed(0)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    prompts = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in (5, 16, 40)]
    off, off_info = greedy(model, 0, prompts, 32, a.device)
    on, on_info = greedy(model, a.graphs, prompts, 32, a.device, reference=off)
    pairs = [(x, y) for a_, b_ in zip(off, on) for x, y in zip(a_, b_)]
    share = sum(x == y for x, y in pairs) / max(1, len(pairs))
    replays = on_info.get("replays", {})
    ok = (
        on_info["graphs"]["enabled"]
        and off == on
        and len(replays) >= 2
        and all(n > 0 for n in replays.values())
        and not on_info["errors"]
        and on_info["tp_failed"] is None
    )
    counts = ", ".join(f"{name.replace('speculative ', '')} {n}" for name, n in replays.items()) or "none"
    detail = (
        f"equal share {share:.3f} over {len(pairs)} tokens (graphs on vs off at tp 2), replays {counts}, "
        f"drafts accepted {on_info.get('drafts', [0, 0])[1]}/{on_info.get('drafts', [0, 0])[0]}, "
        f"graphs {on_info['graphs']['batch_sizes'] or on_info['graphs']['eager_reason']}"
    )
    print(f"CHECK mtp_graphs_tp2: {'PASS' if ok else 'FAIL'} {detail}", flush=True)
    name = torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device
    result = {"device": name, "preset": a.preset, "ok": ok, "equal_share": share}
    result.update(graphs_on=on_info, graphs_off=off_info)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
