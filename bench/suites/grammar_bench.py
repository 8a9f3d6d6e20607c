"""What structured outputs cost: the grammar engine's compile and mask times (xgrammar, and
llguidance when it is importable, on the same vocabulary and schemas), then the cost per decode
step in the engine at concurrency 1/8/32 with every request under a JSON schema vs none.

The engine part runs an in-process Engine (no HTTP), prefills the batch, then times `--steps`
decode steps for each side, alternating sides `--repeats` times and keeping each side's best:
the two sides differ only by the grammar. Per step it also reports the time spent filling the
masks on the CPU (on a GPU that overlaps the forward; on a CPU it adds to it).

    python -m bench.suites.grammar_bench [--model DIR | --preset mla512] [--concurrency 1 8 32] [--steps 24]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from bench import RESULTS
from typing import Optional


from bench.harness import report as rpt  # noqa: E402
from bench.harness.checkpoints import ensure_model  # noqa: E402


# A schema a request keeps following for many tokens (a long array of small records): the
# decode steps measured are all mid-grammar.
LONG_SCHEMA = {
    "type": "array",
    "minItems": 500,
    "items": {
        "type": "object",
        "additionalProperties": False,
        "required": ["id", "name", "tags", "score"],
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 100000},
            "name": {"type": "string", "pattern": "^[a-z ]{1,12}$"},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
            "score": {"type": "number", "minimum": -1, "maximum": 1},
        },
    },
}
COMPILE_SCHEMAS = [
    {"type": "object"},
    LONG_SCHEMA,
    {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "email": {"type": "string", "format": "email"},
            "address": {
                "type": "object",
                "properties": {"street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "zip"],
            },
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--preset", default=None, help="default: mla512 (tiny with --quick)")
    p.add_argument("--concurrency", type=int, nargs="+", action="extend", default=None, help="default: 1 8 32")
    p.add_argument("--steps", type=int, default=None, help="decode steps timed per side and repeat (default: 24)")
    p.add_argument("--repeats", type=int, default=None, help="default: 2")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--spec",
        default="json_schema",
        choices=["json_schema", "auto_tools"],
        help='what every constrained row follows: a long JSON schema, or `tool_choice: "auto"` over two tools '
        "(free text until the call marker; the checkpoint's tool-call format)",
    )
    a = p.parse_args(argv)
    a.preset = a.preset or ("tiny" if a.quick else "mla512")
    a.concurrency = a.concurrency or ([1, 4] if a.quick else [1, 8, 32])
    a.steps = a.steps or (4 if a.quick else 24)
    a.repeats = a.repeats or (1 if a.quick else 2)
    if a.out is None:
        a.out = RESULTS / "quick" if a.quick else RESULTS
        a.out = a.out / "grammar_auto_tools" if a.spec == "auto_tools" else a.out
    return a


# ---- the grammar engines alone ---------------------------------------------------------------


def backend_xgrammar(tok, vocab: int, eos: list[int], schemas: list[dict], walk: list[list[int]]) -> dict:
    import xgrammar as xgr

    from dsv4_engine.structured.grammar import GrammarCompiler, tokenizer_info

    t0 = time.perf_counter()
    info = tokenizer_info(tok.backend, vocab, eos)
    setup = time.perf_counter() - t0
    compile_s, mask_s = [], []
    for schema, ids in zip(schemas, walk):
        gc = GrammarCompiler(info)  # a fresh compiler each time: no cache
        t0 = time.perf_counter()
        from dsv4_engine.structured.spec import json_schema

        cg = gc.compile(json_schema(schema))
        compile_s.append(time.perf_counter() - t0)
        m = xgr.GrammarMatcher(cg)
        bm = xgr.allocate_token_bitmask(1, vocab)
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bm, 0)
            mask_s.append(time.perf_counter() - t0)
            if not m.accept_token(t):
                break
    return {
        "tokenizer_setup_ms": setup * 1e3,
        "compile_ms": [c * 1e3 for c in compile_s],
        "mask_us_median": statistics.median(mask_s) * 1e6,
        "mask_us_p99": sorted(mask_s)[int(0.99 * (len(mask_s) - 1))] * 1e6,
        "mask_steps": len(mask_s),
    }


def backend_llguidance(tok, vocab: int, eos: list[int], schemas: list[dict], walk: list[list[int]]) -> Optional[dict]:
    try:
        import llguidance as llg
        import numpy as np
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
    except ImportError:
        return None
    t0 = time.perf_counter()
    lt = llg.LLTokenizer(tok.backend.to_str(), n_vocab=vocab, eos_token=eos[0])
    setup = time.perf_counter() - t0
    compile_s, mask_s = [], []
    for schema, ids in zip(schemas, walk):
        t0 = time.perf_counter()
        grammar = llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        )
        m = llg.LLMatcher(lt, grammar)
        compile_s.append(time.perf_counter() - t0)
        bm = allocate_token_bitmask(1, vocab)
        for t in ids:
            t0 = time.perf_counter()
            fill_next_token_bitmask(m, bm, 0)
            mask_s.append(time.perf_counter() - t0)
            if not m.consume_token(t):
                break
    del np
    return {
        "tokenizer_setup_ms": setup * 1e3,
        "compile_ms": [c * 1e3 for c in compile_s],
        "mask_us_median": statistics.median(mask_s) * 1e6,
        "mask_us_p99": sorted(mask_s)[int(0.99 * (len(mask_s) - 1))] * 1e6,
        "mask_steps": len(mask_s),
        "version": getattr(llg, "__version__", None),
    }


def compact_instances(tok) -> list[list[int]]:
    """Token ids of one instance of each compile schema, in the compact form both engines emit
    with whitespace off (the walk whose masks are timed)."""
    rec = {"id": 4217, "name": "alpha beta", "tags": ["red", "blue"], "score": 0.25}
    texts = [{"k": 1}, [rec] * 40, {"name": "Ann Lee", "age": 33, "address": {"street": "Main St 1", "zip": "12345"}}]
    return [tok.encode(json.dumps(t), add_bos=False) for t in texts]


# ---- the engine, per decode step -------------------------------------------------------------

AGENT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "shell",
            "parameters": {
                "type": "object",
                "properties": {"cmd": {"type": "string"}, "timeout": {"type": "integer", "minimum": 1}},
                "required": ["cmd"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "read_file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}},
    },
]


def auto_tools_spec(model: Path):
    """`tool_choice: "auto"` as the HTTP process builds it, in the checkpoint's tool-call format."""
    from dsv4_engine.structured.spec import tool_calls

    model_type = json.loads((Path(model) / "config.json").read_text()).get("model_type")
    parser = "deepseek_v4" if model_type == "deepseek_v4" else "deepseek_v31"
    return tool_calls(parser, AGENT_TOOLS, "auto")


def engine_steps(model: Path, conc: int, a: argparse.Namespace) -> dict:
    import torch

    from dsv4_engine.engine import Engine
    from dsv4_engine.engine_args import EngineArgs
    from dsv4_engine.sampling_params import SamplingParams
    from dsv4_engine.sequence import Sequence
    from dsv4_engine.structured.spec import json_schema

    torch.manual_seed(a.seed)
    eng = Engine(
        EngineArgs(
            model=str(model),
            device=None,
            kv_pages=max(256, conc * 8),
            page_size=16,
            max_num_seqs=max(conc, 8),
            enable_prefix_cache=False,
        )
    )
    import dsv4_engine.engine as engine_mod
    import dsv4_engine.sampling as sampling_mod
    import dsv4_engine.structured.bitmask as bitmask_mod

    # The grammar's own work per step, timed where it happens: the masks filled on the CPU, the
    # mask applied to the logits (on a GPU this times the launch only), each token accepted.
    fill_time = [0.0]
    depth = [0]  # the outermost timed call counts (the mask fill calls ensure_matcher too)

    def timed(fn):
        def run(*args, **kw):
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    fill_time[0] += time.perf_counter() - t0

        return run

    eng.runner.grammar_masks = timed(eng.runner.grammar_masks)
    sampling_mod.apply_token_mask = timed(sampling_mod.apply_token_mask)
    bitmask_mod.ensure_matcher = timed(bitmask_mod.ensure_matcher)
    del engine_mod
    spec = json_schema(LONG_SCHEMA) if a.spec == "json_schema" else auto_tools_spec(model)
    vocab = eng.cfg.vocab_size

    def side(with_grammar: bool, rep: int) -> dict:
        seqs = []
        for i in range(conc):
            prompt = [(7 + 31 * i + 13 * j + rep) % (vocab - 10) + 4 for j in range(a.prompt_len)]
            params = SamplingParams(
                max_tokens=a.steps + 4,
                temperature=0.7,
                seed=i,
                ignore_eos=not with_grammar,
                structured=spec if with_grammar else None,
            )
            s = Sequence(f"{'g' if with_grammar else 'p'}{rep}-{i}", prompt, params)
            seqs.append(s)
            eng.submit(s)
        while not all(s.output_ids for s in seqs):  # prefill (and the first token)
            eng.step()
        if eng.runner.device.type == "cuda":
            torch.cuda.synchronize()
        fill_time[0] = 0.0
        times = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t0)
        fills = fill_time[0]
        running = sum(not s.finished for s in seqs)
        print(
            f"  c{conc} {'grammar' if with_grammar else 'plain'} run {rep}: step median {statistics.median(times) * 1e3:.1f} ms, "
            f"grammar work {fill_time[0] / a.steps * 1e3:.3f} ms/step",
            flush=True,
        )
        for s in seqs:
            eng.abort(seq=s)
        eng.step()
        return {
            "step_ms_median": statistics.median(times) * 1e3,
            "step_ms_min": min(times) * 1e3,
            "grammar_ms_per_step": fills / a.steps * 1e3,
            "still_running": running,
        }

    side(True, -1)  # warm: compile, first matchers, allocator
    side(False, -1)
    runs = {"plain": [], "grammar": []}
    for rep in range(a.repeats):
        runs["plain"].append(side(False, rep))
        runs["grammar"].append(side(True, rep))
    best = {k: min(v, key=lambda r: r["step_ms_median"]) for k, v in runs.items()}
    plain, gram = best["plain"]["step_ms_median"], best["grammar"]["step_ms_median"]
    eng.stop()
    return {
        "concurrency": conc,
        "device": str(eng.runner.device),
        "plain": best["plain"],
        "grammar": best["grammar"],
        "overhead_pct": (gram - plain) / plain * 100,
        "grammar_work_pct_of_plain_step": best["grammar"]["grammar_ms_per_step"] / plain * 100,
        "runs": runs,
    }


def plot(report: dict, path: Path) -> None:
    plt = rpt.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    rows = report["engine"]
    groups = [f"c{r['concurrency']}" for r in rows]
    rpt.grouped_bars(
        axes[0],
        groups,
        {
            "no grammar": [r["plain"]["step_ms_median"] for r in rows],
            "json_schema, every row": [r["grammar"]["step_ms_median"] for r in rows],
            "of which grammar work": [r["grammar"]["grammar_ms_per_step"] for r in rows],
        },
        f"decode step, {report['preset']} ({rows[0]['device'] if rows else '?'})",
        "ms (median)",
    )
    b = report["backends"]
    names = [n for n in ("xgrammar", "llguidance") if b.get(n)]
    rpt.grouped_bars(
        axes[1],
        ["compile (ms, mean)", "mask / token (us, median)"],
        {n: [statistics.mean(b[n]["compile_ms"]), b[n]["mask_us_median"]] for n in names},
        f"grammar engines, vocab {report['vocab_size']}",
        "",
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(argv)
    model = a.model or ensure_model(None, a.preset, a.seed)
    from dsv4_engine.tokenizer import Tokenizer

    cfg = json.loads((Path(model) / "config.json").read_text())
    tok = Tokenizer.from_dir(model)
    vocab, eos = cfg["vocab_size"], sorted(set(tok.eos_ids))
    walk = compact_instances(tok)
    report = {
        "bench": "grammar",
        "started": rpt.now_iso(),
        "preset": a.preset,
        "model": str(model),
        "vocab_size": vocab,
        "args": {k: str(v) for k, v in vars(a).items()},
        "machine": rpt.machine(),
        "backends": {
            "xgrammar": backend_xgrammar(tok, vocab, eos, COMPILE_SCHEMAS, walk),
            "llguidance": backend_llguidance(tok, vocab, eos, COMPILE_SCHEMAS, walk),
        },
    }
    report["engine"] = [engine_steps(Path(model), c, a) for c in a.concurrency]
    top = report["engine"][-1]
    # The target is judged on the grammar's own work per step (mask fill, mask, accept), timed
    # where it runs: the step-time difference is also reported, but on a shared CPU machine the
    # noise between two runs of the same step is larger than the grammar's cost.
    report["targets"] = [
        rpt.target(
            f"grammar work per decode step at c{top['concurrency']} (% of a plain step)",
            round(top["grammar_work_pct_of_plain_step"], 2),
            5.0,
            higher_better=False,
        )
    ]
    for r in report["engine"]:
        print(
            f"c{r['concurrency']:>3}: plain {r['plain']['step_ms_median']:.2f} ms, grammar {r['grammar']['step_ms_median']:.2f} ms "
            f"({r['overhead_pct']:+.1f}%), grammar work {r['grammar']['grammar_ms_per_step']:.3f} ms/step "
            f"({r['grammar_work_pct_of_plain_step']:.2f}% of a plain step)"
        )
    for name, b in report["backends"].items():
        if b:
            print(
                f"{name}: compile {', '.join(f'{c:.2f}' for c in b['compile_ms'])} ms; mask {b['mask_us_median']:.1f} us median, "
                f"{b['mask_us_p99']:.1f} us p99 over {b['mask_steps']} tokens"
            )
    a.out.mkdir(parents=True, exist_ok=True)
    rpt.write_json(report, a.out / "grammar.json")
    plot(report, a.out / "grammar.png")
    print(f"wrote {a.out / 'grammar.json'} and {a.out / 'grammar.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
