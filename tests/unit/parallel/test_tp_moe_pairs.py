"""Expert parallelism computes each routed (token, expert) pair once, on the rank that holds the
expert: two real ranks over gloo (two processes) each count the pairs their expert calls
compute; together they are every routed pair, neither computes the other's, and the summed
output equals one rank's (tp 1)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import torch

from dsv4_engine.model_runner import ModelRunner
from dsv4_engine.parallel.group import free_port

RANK = Path(__file__).with_name("moe_pairs_rank.py")


def rank_module():
    spec = importlib.util.spec_from_file_location("moe_pairs_rank", RANK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_ranks(model_dir: Path, size: int, tmp_path: Path) -> list[dict]:
    port = free_port()
    outs = [tmp_path / f"size{size}-rank{r}.pt" for r in range(size)]
    procs = [
        subprocess.Popen([sys.executable, str(RANK), str(model_dir), str(r), str(size), str(port), str(outs[r])])
        for r in range(size)
    ]
    try:
        for p in procs:
            assert p.wait(timeout=120) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [torch.load(o) for o in outs]


def test_each_rank_computes_only_its_experts_pairs(tiny_model, tmp_path):
    """tiny: 8 routed experts, 4 a rank. (V4's routed experts take the same ShardComm ids and
    skip -1 the same way; its tp 2 == tp 1 test is in test_tp_engine.py.)"""
    model = tiny_model
    logits, computed, routed = rank_module().prefill_and_count(ModelRunner(model, device="cpu", kernel_backend="cpu"))
    whole = {"logits": logits, "computed": computed, "routed": routed}
    ranks = run_ranks(model, 2, tmp_path)
    routed = whole["routed"]
    assert routed > 0 and whole["computed"] == routed
    assert [r["routed"] for r in ranks] == [routed, routed]  # the router is replicated
    computed = [r["computed"] for r in ranks]
    assert sum(computed) == routed, f"pairs computed per rank {computed}, {routed} routed in all"
    assert all(0 < c < routed for c in computed)
    for r in ranks:  # sums over ranks change the order of additions only
        torch.testing.assert_close(r["logits"], whole["logits"], atol=1e-4, rtol=1e-4)
