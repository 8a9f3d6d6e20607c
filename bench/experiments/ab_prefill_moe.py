"""The V3 MoE / dense MLP at prefill widths on the CPU, before (the torch forms as they were:
index_select gathers, F.silu then a multiply, weight + gather back + sum over k, the shared
expert as its own add) and after (dsv4_kernels.cpu_grouped_moe's native passes around the same
GEMMs), interleaved in one process, 1 torch thread, CPU time of the thread, best of N:

  * one layer's `_moe` (routed + shared) and the dense layer's `_mlp` on the checkpoint's own
    weights at T = 128, 512, 1048 tokens (random hidden states), outputs compared;
  * a whole mixed step as bench/experiments/ab_mixed_step.py drives it (24 decodes + 8 fresh 128-token
    prompts = 1048 tokens), with the "moe" phase's CPU time (dsv4_engine.step_phases) and the
    greedy tokens of every request compared.

    python -m bench.experiments.ab_prefill_moe --model /tmp/smla/mla512 [--reps 15 --rounds 6] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.experiments import ab_mixed_step as mixed  # noqa: E402
from bench.suites import decode_breakdown as bd  # noqa: E402


# ---- the before side: the torch forms as they were --------------------------------------------


def _old_grouped(x, w13, w2, topk_weights, topk_ids):
    T, hidden = x.shape
    top_k, E = topk_ids.shape[1], w13.shape[0]
    flat = topk_ids.reshape(-1).to(torch.long)
    flat = torch.where((flat >= 0) & (flat < E), flat, E)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E + 1).tolist()
    live = T * top_k - counts[E]
    xs = x.index_select(0, order[:live] // top_k)
    gate_up = torch.empty(live, w13.shape[1])
    start = 0
    for e, n in enumerate(counts[:E]):
        if n:
            torch.mm(xs[start : start + n], w13[e].t(), out=gate_up[start : start + n])
            start += n
    inter = gate_up.shape[1] // 2
    h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    ys = torch.empty(T * top_k, hidden)
    start = 0
    for e, n in enumerate(counts[:E]):
        if n:
            torch.mm(h[start : start + n], w2[e].t(), out=ys[start : start + n])
            start += n
    ys[live:].zero_()
    ys[:live].mul_(topk_weights.reshape(-1)[order[:live]][:, None])
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel())
    return ys.index_select(0, back).view(T, top_k, hidden).sum(dim=1)


def _old_mlp(self, x, w13, w2):
    from dsv4_kernels import cpu_moe

    if cpu_moe.applies(x, w13, w2):
        return cpu_moe.mlp(x, w13, w2)
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def _old_moe(self, x, input_ids=None):
    """The MoE layer (a dsv4_engine.layers.moe.DeepseekMoE) as it ran before."""
    from dsv4_kernels import cpu_moe, cpu_moe_route

    r, ops = self.router, self.ops
    logits = F.linear(x.float(), r.gate)
    native = cpu_moe_route.available() and cpu_moe_route.supports(logits, r.bias)
    weights, ids = (cpu_moe_route.moe_route if native else ops.moe_route)(
        logits, r.bias, r.n_group, r.topk_group, r.top_k, r.norm_topk_prob, r.scaling
    )
    if self.tp is not None:
        weights, ids = self.tp.local_experts(weights, ids)
    shared = self.shared or (None, None)
    if cpu_moe.applies(x, self.w13, self.w2, *shared):
        out = cpu_moe.experts(x, self.w13, self.w2, weights, ids, self.shared)
    else:
        out = _old_grouped(x, self.w13, self.w2, weights, ids)
        if self.shared is not None:
            out = out + _old_mlp(None, x, *self.shared)
    return out if self.tp is None else self.tp.all_reduce(out)


def _old_dense(self, x):
    """The dense MLP layer (a dsv4_engine.layers.mlp.GatedMLP) as it ran before."""
    out = _old_mlp(None, x, self.w13, self.w2)
    return out if self.reduce is None else self.reduce(out)


class _Side:
    """Swaps the MLP and MoE layers' forwards for the before forms while `before` is on."""

    def __init__(self):
        from dsv4_engine.layers.mlp import GatedMLP
        from dsv4_engine.layers.moe import DeepseekMoE

        self.classes = (GatedMLP, DeepseekMoE)
        self.new = (GatedMLP.__call__, DeepseekMoE.__call__)

    def set(self, name: str) -> None:
        forms = (_old_dense, _old_moe) if name == "before" else self.new
        for cls, form in zip(self.classes, forms):
            cls.__call__ = form


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t)
    return best * 1000


def layers(engine, side: _Side, widths: list[int], reps: int) -> dict:
    model = engine.runner.local_model
    from dsv4_engine.layers.mlp import GatedMLP
    from dsv4_engine.layers.moe import DeepseekMoE

    moe_L = next(L.mlp for L in model.layers if isinstance(L.mlp, DeepseekMoE))
    dense_L = next((L.mlp for L in model.layers if isinstance(L.mlp, GatedMLP)), None)
    out: dict = {}
    for T in widths:
        g = torch.Generator().manual_seed(T)
        x = torch.randn(T, model.cfg.hidden_size, generator=g)
        calls = {"moe": lambda: moe_L(x)}
        if dense_L is not None:
            calls["dense_mlp"] = lambda: dense_L(x)
        for what, fn in calls.items():
            ms: dict = {"before": float("inf"), "after": float("inf")}
            res = {}
            for r in range(6):  # interleaved rounds, best of all
                for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
                    side.set(name)
                    res[name] = fn()
                    ms[name] = min(ms[name], _best(fn, reps))
            side.set("after")
            diff = (res["before"] - res["after"]).abs().max().item()
            scale = res["before"].abs().max().item()
            out[f"{what}_T{T}"] = {
                "cpu_ms_best": {k: round(v, 3) for k, v in ms.items()},
                "speedup": round(ms["before"] / ms["after"], 3),
                "max_abs_diff": diff,
                "max_abs": scale,
                "identical": diff == 0.0,
            }
            print(f"{what} T={T}: {out[f'{what}_T{T}']}", flush=True)
    return out


def mixed_step(engine, side: _Side, decodes: int, prefills: int, rounds: int) -> dict:
    from dsv4_engine.step_phases import PHASES

    PHASES.enable(True, None, cpu_clock=True)
    step: dict = {"before": [], "after": []}
    moe: dict = {"before": [], "after": []}
    tokens: dict = {}
    for r in range(rounds + 1):
        for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
            side.set(name)
            running = mixed._add(engine, decodes, 2000 + r, 8)
            while any(not s.output_ids for s in running):
                engine.step()
            engine.step()
            fresh = mixed._add(engine, prefills, 3000 + r, 2)
            PHASES.reset()
            c0 = time.thread_time()
            engine.step()
            ms = (time.thread_time() - c0) * 1000
            assert all(s.output_ids for s in fresh), "the fresh prompts did not prefill in one step"
            phases = PHASES.summary()["mixed"]["phases"]
            if r > 0:  # round 0 warms up
                step[name].append(round(ms, 1))
                moe[name].append(round(phases["moe"]["ms_per_step"], 1))
            while engine.scheduler.has_work():
                engine.step()
            tokens.setdefault(r, {})[name] = [s.output_ids for s in running + fresh]
    side.set("after")
    PHASES.enable(False)
    return {
        "decodes": decodes,
        "prefills": prefills,
        "prompt_len": 128,
        "step_tokens": decodes + prefills * 128,
        "moe_phase_cpu_ms_best": {k: min(v) for k, v in moe.items()},
        "moe_phase_speedup": round(min(moe["before"]) / min(moe["after"]), 3),
        "mixed_step_cpu_ms_best": {k: min(v) for k, v in step.items()},
        "mixed_step_speedup": round(min(step["before"]) / min(step["after"]), 3),
        "moe_phase_cpu_ms_each": moe,
        "mixed_step_cpu_ms_each": step,
        "tokens_identical": all(t["before"] == t["after"] for t in tokens.values()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--widths", default="128,512,1048", help="layer widths ('' skips the layer A/B)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--decodes", type=int, default=24)
    p.add_argument("--prefills", type=int, default=8)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--out")
    a = p.parse_args()
    torch.set_num_threads(1)
    engine = bd._engine(Path(a.model), a.decodes + a.prefills, 384, 8)
    side = _Side()
    r = {
        "model": a.model,
        "torch_threads": 1,
        "loadavg_start": os.getloadavg(),
        "layers": layers(engine, side, [int(w) for w in a.widths.split(",") if w], a.reps),
        "mixed_step": mixed_step(engine, side, a.decodes, a.prefills, a.rounds),
        "loadavg_end": os.getloadavg(),
    }
    text = json.dumps(r, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
