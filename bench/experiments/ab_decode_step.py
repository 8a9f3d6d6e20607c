"""Whole decode steps before/after this round's changes, interleaved in one engine (in process,
1 torch thread): the same running batch steps a few times with the earlier torch-backend code
(per-expert index_add MoE, the whole batch's keys in one attention tile), then a few times with
the current code, and so on, keeping each side's best step and its phase breakdown. On a shared
machine this is the fair comparison; two separate runs minutes apart are not.

    python -m bench.experiments.ab_decode_step --model mla512=DIR [-c 8 -c 32] [--rounds 6 --steps 3] [--change NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from bench.experiments import ab_moe  # noqa: E402
from bench.suites import decode_breakdown as bd  # noqa: E402


def _patcher(module, before: dict, after: dict) -> dict:
    """Two sides that set module attributes: 'before' (the earlier code) and 'after' (now)."""

    def use(side: dict) -> None:
        for k, v in side.items():
            setattr(module, k, v)

    return {"before": lambda: use(before), "after": lambda: use(after)}


def _round1():
    """Issue 33's first pass: per-expert index_add MoE and the whole batch's keys in one tile."""
    from dsv4_kernels import reference as R

    now = {"moe_experts": R.moe_experts, "DECODE_TILE_BYTES": R.DECODE_TILE_BYTES}
    before = {"moe_experts": ab_moe.loop_experts_any, "DECODE_TILE_BYTES": 1 << 62}
    return _patcher(R, before, now)


def _gather():
    """The decode's page gather: advanced indexing (before) vs index_select over page runs."""
    from dsv4_kernels import reference as R

    return _patcher(R, {"take_pages": lambda cache, pages: cache[pages]}, {"take_pages": R.take_pages})


def _native_moe():
    """The MoE layers (routed + shared experts, dense MLP) at decode sizes: the torch grouped
    form (before) vs one native call per layer (dsv4_kernels.cpu_moe)."""
    from dsv4_kernels import cpu_moe

    return _patcher(cpu_moe, {"MAX_TOKENS": 0}, {"MAX_TOKENS": cpu_moe.MAX_TOKENS})


def _native_mla():
    """The V3 decode attention: the torch form (before) vs the native C decode (dsv4_kernels.cpu_mla)."""
    from dsv4_kernels import cpu_mla

    if not cpu_mla.available():
        raise SystemExit("the native decode is not available here (no C compiler, or turned off)")
    return _patcher(cpu_mla, {"supports": lambda q, kv: False}, {"supports": cpu_mla.supports})


def _native_norm():
    """The V3 RMSNorms (17 a step): the torch form (before) vs one native call each
    (dsv4_kernels.cpu_rmsnorm)."""
    from dsv4_kernels import cpu_rmsnorm

    if not cpu_rmsnorm.available():
        raise SystemExit("the native rmsnorm is not available here (no C compiler, or turned off)")
    return _patcher(cpu_rmsnorm, {"supports": lambda *a: False}, {"supports": cpu_rmsnorm.supports})


def _native_rope():
    """The V3 ropes (8 a step): the torch form (before) vs one native call each (dsv4_kernels.cpu_rope)."""
    from dsv4_kernels import cpu_rope

    if not cpu_rope.available():
        raise SystemExit("the native rope is not available here (no C compiler, or turned off)")
    return _patcher(cpu_rope, {"supports": lambda *a: False}, {"supports": cpu_rope.supports})


def _native_route():
    """The V3 router's expert choice: the torch form (before) vs one native call a layer
    (dsv4_kernels.cpu_moe_route; the same ids, ties fall back to torch)."""
    from dsv4_kernels import cpu_moe_route

    if not cpu_moe_route.available():
        raise SystemExit("the native routing is not available here (no C compiler, or turned off)")
    return _patcher(cpu_moe_route, {"supports": lambda *a: False}, {"supports": cpu_moe_route.supports})


def _native_norm_rope():
    """Both of the above at once: the V3 norms and ropes in torch (before) vs native."""
    a, b = _native_norm(), _native_rope()
    return {side: (lambda side=side: (a[side](), b[side]())) for side in ("before", "after")}


def _pass6():
    """Section 6 whole: the V3 norms, ropes and expert choice in torch (before) vs native."""
    parts = (_native_norm(), _native_rope(), _native_route())
    return {side: (lambda side=side: [p[side]() for p in parts]) for side in ("before", "after")}


def _native_absorb():
    """The V3 per-head projections around the attention (W_UK into the query, W_UV out of the
    latent): bmm + transpose + cat / reshape in torch (before) vs one native pass each
    (dsv4_kernels.cpu_mla_absorb)."""
    from dsv4_kernels import cpu_mla_absorb

    if not cpu_mla_absorb.available():
        raise SystemExit("the native absorb is not available here (no C compiler, or turned off)")
    return _patcher(cpu_mla_absorb, {"supports": lambda *a: False}, {"supports": cpu_mla_absorb.supports})


def _native_linear():
    """The V3 decode step's dense projections (q_a, q_b, kv_a, o, the router gate, the lm_head):
    F.linear / MKL (before) vs the MoE loop's small-M linear (dsv4_kernels.cpu_moe.linear)."""
    from dsv4_kernels import cpu_moe

    if not cpu_moe.available():
        raise SystemExit("the native linear is not available here (no C compiler, or turned off)")
    return _patcher(cpu_moe, {"MAX_LINEAR_TOKENS": 0}, {"MAX_LINEAR_TOKENS": cpu_moe.MAX_LINEAR_TOKENS})


# --change NAME: which earlier code the "before" side runs
CHANGES = {
    "round1": _round1,
    "gather": _gather,
    "native-moe": _native_moe,
    "native-mla": _native_mla,
    "native-norm": _native_norm,
    "native-rope": _native_rope,
    "native-norm-rope": _native_norm_rope,
    "native-route": _native_route,
    "pass6": _pass6,
    "native-absorb": _native_absorb,
    "native-linear": _native_linear,
}


def sides(change: str = "round1"):
    return CHANGES[change]()


def measure(
    model: Path,
    c: int,
    rounds: int,
    steps: int,
    change: str = "round1",
    check_tokens: int = 0,
    cpu_phases: bool = False,
) -> dict:
    from dsv4_engine.step_phases import PHASES

    engine = bd._engine(model, c, 128, rounds * steps * 2 + 8)
    seqs = bd._fill(engine, c, 128, rounds * steps * 2 + 8, seed=0)
    use = sides(change)
    best: dict = {}
    cpu_best: dict = {}
    each: dict = {k: [] for k in use}
    try:
        for r in range(rounds):
            for name in list(use) if r % 2 == 0 else list(reversed(use)):
                use[name]()
                PHASES.enable(True, cpu_clock=cpu_phases)
                t0, c0 = time.perf_counter(), time.thread_time()
                for _ in range(steps):
                    engine.step()
                ms = (time.perf_counter() - t0) * 1000 / steps
                cpu_ms = (time.thread_time() - c0) * 1000 / steps
                each[name].append(round(ms, 2))
                if ms < best.get(name, (1e9,))[0]:
                    best[name] = (ms, best.get(name, (0, None))[1])
                if (cpu_ms if cpu_phases else ms) <= (cpu_best.get(name, 1e9) if cpu_phases else best[name][0]):
                    # the phases of the best step: by CPU time with --cpu-phases, else by wall
                    best[name] = (best[name][0], PHASES.summary().get("decode"))
                cpu_best[name] = min(cpu_best.get(name, 1e9), cpu_ms)
                PHASES.enable(False)
        engine.abort(all_=True)
        engine.step()
        assert all(s.output_ids for s in seqs)
        same = None
        if check_tokens:  # the same prompts decoded greedily by each side: identical tokens?
            got = {}
            for name in use:
                use[name]()
                done = bd._fill(engine, c, 128, check_tokens, seed=1)
                while engine.scheduler.has_work():
                    engine.step()
                got[name] = [s.output_ids for s in done]
            same = got["before"] == got["after"]
    finally:
        use["after"]()
    return {
        "concurrency": c,
        "step_ms_best": {k: round(v[0], 2) for k, v in best.items()},
        "speedup": round(best["before"][0] / best["after"][0], 2),
        # CPU time of the stepping thread (torch runs on it with 1 thread): what the step costs
        # without the waits for a core that a loaded shared machine adds to the wall clock
        "step_cpu_ms_best": {k: round(v, 2) for k, v in cpu_best.items()},
        "cpu_speedup": round(cpu_best["before"] / cpu_best["after"], 2),
        "greedy_tokens_identical": same,
        "step_ms_each": each,
        "phases_clock": "thread CPU" if cpu_phases else "wall",
        "phases_best": {
            k: {p: v["ms_per_step"] for p, v in (b[1] or {}).get("phases", {}).items()} for k, b in best.items()
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", required=True, help="NAME=DIR")
    p.add_argument("-c", "--concurrency", type=int, action="append")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--change", default="round1", choices=sorted(CHANGES), help="which change to undo on the before side"
    )
    p.add_argument(
        "--check-tokens",
        type=int,
        default=0,
        help="then decode N greedy tokens of other prompts with each side and compare",
    )
    p.add_argument(
        "--cpu-phases", action="store_true", help="phase laps on the stepping thread's CPU clock, not the wall"
    )
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    torch.set_num_threads(1)
    out = {"change": a.change, "cpu_phases": a.cpu_phases, "load_average_start": list(os.getloadavg()), "models": {}}
    for spec in a.model:
        name, _, d = spec.partition("=")
        out["models"][name] = []
        for c in a.concurrency or [8, 32]:
            r = measure(Path(d), c, a.rounds, a.steps, a.change, a.check_tokens, a.cpu_phases)
            out["models"][name].append(r)
            print(name, json.dumps(r))
    out["load_average_end"] = list(os.getloadavg())
    if a.out:
        a.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
