"""`dsv4 bench agents`: an agent harness replayed against real servers. --agents agents run at
once, each for --rounds rounds; every round is a streamed chat completion with `tools` and
`tool_choice: "auto"` as agent harnesses send it (`--tool-choice required` forces a call), then a
~--result-tokens-token tool result is appended (or, after an answer without a call, a user's "go
on") and the next, longer round sent. Random weights rarely open a call on their own, so the
tokens that open one get a logit bias (`--marker-bias 0` turns it off).

Counted per side, per 1,000 rounds: malformed calls (tool-call markup left in `content`, or a
returned call whose arguments are not an object of the tool's required keys), lost calls (the
output opened a call block, stopped, and no call came back), and calls cut by max_tokens; with the
`auto` grammar on and off (`--grammar on off`: off starts the engines with
`--disable-auto-tool-grammar`, the raw model).

Measured per round: TTFT (time to the first streamed chunk, which goes out with the first token) p50/p90 over the agents, and the
wall time of the whole run; for each preset (V3 `tiny`, V4 `v4-tiny` by default), mono and PD
(prefill + decode behind the router, KV over NIXL), with and without the prefix cache. The
checkpoints get a longer context (random weights; positions raised in config.json) so that six
rounds of tool results fit. Writes OUT/agents.json and OUT/agents.png.

    python -m bench.suites.agents_bench [--presets tiny v4-tiny] [--agents 16] [--rounds 6] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

from bench.harness.checkpoints import RESULTS, ensure_model
from bench.harness.procs import Server, free_port
from bench.harness.report import machine, now_iso, pyplot, write_json

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "shell",
            "description": "Run a shell command and return its output.",
            "parameters": {
                "type": "object",
                "properties": {
                    "cmd": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                    "timeout": {"type": "integer", "minimum": 1, "maximum": 60},
                },
                "required": ["cmd"],
                "additionalProperties": False,
            },
        },
    }
]
WORDS = (
    "file line error build test pass fail module import value return object list index count path "
    "config server request token cache page decode prefill router agent round result output"
).split()


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=None, help="checkpoint presets (default: tiny v4-tiny)")
    p.add_argument("--agents", type=int, default=None, help="concurrent agents (default 16)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per agent (default 6)")
    p.add_argument("--result-tokens", type=int, default=300, help="tool result length per round, in tokens (about)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=160,
        help="answer budget per round (a V3.1 call takes ~20 tokens, a V4 DSML one ~60-100)",
    )
    p.add_argument("--modes", nargs="+", default=["mono", "pd"], choices=["mono", "pd"])
    p.add_argument(
        "--tool-choice", default="auto", choices=["auto", "required"], help='as the harness sends it (default "auto")'
    )
    p.add_argument("--grammar", nargs="+", default=["on", "off"], choices=["on", "off"], help="auto tool grammar sides")
    p.add_argument("--caches", nargs="+", default=["on", "off"], choices=["on", "off"], help="prefix cache sides")
    p.add_argument("--marker-bias", type=float, default=4.0, help="logit bias toward the call-opening tokens")
    p.add_argument("--kv-pages", type=int, default=None, help="KV pool per engine in pages (default 2048)")
    p.add_argument("--out", type=Path, default=None, help="results folder (default bench/results/agents)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes: 2 agents x 2 rounds, tiny preset, mono")
    a = p.parse_args(argv)
    full = dict(presets=["tiny", "v4-tiny"], agents=16, rounds=6, kv_pages=2048)
    quick = dict(presets=["tiny"], agents=2, rounds=2, kv_pages=512)
    for k, v in (quick if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.quick:
        a.modes, a.grammar = ["mono"], ["on"]
    a.out = a.out or (RESULTS / "agents" / ("quick" if a.quick else ""))
    return a


def long_context(model: Path, positions: int = 8192) -> Path:
    """A copy of the checkpoint with `positions` positions: six rounds of 300-token tool results
    outgrow the tiny presets' 1-2k. Random weights do not mind; the serving path is what is timed."""
    out = model.parent / f"{model.name}-ctx{positions}"
    if not (out / "config.json").is_file():
        shutil.copytree(model, out, dirs_exist_ok=True)
        cfg = json.loads((out / "config.json").read_text())
        cfg["max_position_embeddings"] = max(positions, cfg["max_position_embeddings"])
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


# ---- servers -----------------------------------------------------------------------------------


def start(
    mode: str, model: Path, cache: bool, a: argparse.Namespace, logs: Path, grammar: bool = True
) -> tuple[str, list[Server]]:
    common = [
        "--model",
        model,
        "--kv-pages",
        a.kv_pages,
        "--max-num-seqs",
        max(16, a.agents),
        "--served-model-name",
        "bench",
    ] + ([] if cache else ["--disable-prefix-cache"])
    common += [] if grammar else ["--disable-auto-tool-grammar"]
    tag = f"{model.name}-{mode}-{'cache' if cache else 'nocache'}-{'grammar' if grammar else 'raw'}"
    if mode == "mono":
        port = free_port()
        s = Server.dsv4(f"{tag}-mono", ["serve", *common, "--port", port], port, logs)
        return s.url, [s]
    pp, bp, dp, rp = (free_port() for _ in range(4))
    prefill = Server.dsv4(
        f"{tag}-prefill", ["serve", *common, "--role", "prefill", "--port", pp, "--bootstrap-port", bp], pp, logs
    )
    decode = Server.dsv4(f"{tag}-decode", ["serve", *common, "--role", "decode", "--port", dp], dp, logs)
    procs = [prefill, decode]
    for s in procs:
        s.wait_ready(300)
    router = Server.dsv4(
        f"{tag}-router",
        ["router", "--prefill", prefill.url, "--decode", decode.url, "--port", rp, "--health-interval", "1"],
        rp,
        logs,
    )
    return router.url, procs + [router]


# ---- the harness -------------------------------------------------------------------------------


def tool_result(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of tool output (the tiny presets' tokenizer spends ~3 tokens on one of
    these words with its space; the JSON records the prompt lengths really seen)."""
    return " ".join(rng.choice(WORDS) for _ in range(max(1, tokens // 3)))


def marker_ids(model: Path) -> dict[str, int]:
    """The ids of the tokens that open a call block: V3.1's one-token marker, DSML's `｜DSML｜`
    (after "<"), and "<"."""
    from dsv4_wire import chat_tokens as T

    tok = json.loads((model / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"] if t["content"] in (T.DSML, T.TOOL_CALLS_BEGIN)}
    ids["<"] = tok["model"]["vocab"]["<"]
    return ids


def marker_bias(model: Path, bias: float) -> dict:
    from dsv4_wire import chat_tokens as T

    if not bias:
        return {}
    scale = {T.DSML: 7.5, T.TOOL_CALLS_BEGIN: 1.25, "<": 1.0}  # DSML opens only after "<": make it follow
    return {str(i): bias * scale[m] for m, i in marker_ids(model).items()}


def judge(r: dict, opener_ids: set[int]) -> dict:
    """One round's verdict: malformed (markup in content, or a call that is not an object of the
    tool's required keys), lost (a block was opened, the answer stopped, no call came back), cut
    (a block was opened and max_tokens ended it)."""
    from dsv4_wire import chat_tokens as T

    schema = TOOLS[0]["function"]["parameters"]
    bad_call = False
    for c in r["calls"]:
        try:
            args = json.loads(c["arguments"])
        except ValueError:
            args = None
        if c["name"] != TOOLS[0]["function"]["name"] or not isinstance(args, dict):
            bad_call = True
        elif not set(schema["required"]) <= set(args) or not set(args) <= set(schema["properties"]):
            bad_call = True
    leaked = any(
        m in r["content"] for m in (T.DSML, T.TOOL_CALLS_BEGIN, T.TOOL_CALL_BEGIN, T.TOOL_SEP, T.TOOL_CALL_END)
    )
    opened = bool(opener_ids & set(r["token_ids"]))
    return {
        "malformed": leaked or bad_call,
        "lost": opened and not r["calls"] and r["finish"] != "length",
        "cut": opened and not r["calls"] and r["finish"] == "length",
    }


async def one_round(
    client: httpx.AsyncClient, url: str, messages: list, max_tokens: int, tool_choice: str = "required", bias=None
) -> dict:
    body = {
        "model": "bench",
        "messages": messages,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        **({"logit_bias": bias} if bias else {}),
    }
    t0 = time.perf_counter()
    ttft = None
    calls: dict[int, dict] = {}
    content, token_ids = "", []
    finish = usage = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code}: {(await r.aread())[:300]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            usage = ev.get("usage") or usage
            for ch in ev.get("choices") or []:
                d = ch.get("delta") or {}
                if ttft is None:  # the role chunk goes out with the first token
                    ttft = time.perf_counter() - t0
                content += d.get("content") or ""
                token_ids += ch.get("token_ids") or []
                for tc in d.get("tool_calls") or []:
                    c = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
                    c["id"] = tc.get("id") or c["id"]
                    fn = tc.get("function") or {}
                    c["name"] = fn.get("name") or c["name"]
                    c["arguments"] += fn.get("arguments") or ""
                finish = ch.get("finish_reason") or finish
    return {
        "ttft": ttft,
        "latency": time.perf_counter() - t0,
        "finish": finish,
        "calls": [calls[i] for i in sorted(calls)],
        "content": content,
        "token_ids": token_ids,
        "prompt_tokens": (usage or {}).get("prompt_tokens"),
        "cached_tokens": ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens"),
    }


async def agent(client, url: str, k: int, a: argparse.Namespace) -> list[dict]:
    rng = random.Random(a.seed * 1000 + k)
    messages = [
        {"role": "system", "content": f"You are agent {k}. Work with the shell tool."},
        {"role": "user", "content": f"Task {k}: " + tool_result(rng, 120)},
    ]
    out = []
    for i in range(a.rounds):
        r = await one_round(client, url, messages, a.max_tokens, a.tool_choice, a.bias)
        out.append(r)
        if r.get("error"):
            break
        if not r["calls"]:  # an answer without a call: the user asks the agent to go on
            messages += [
                {"role": "assistant", "content": r["content"]},
                {"role": "user", "content": "Go on: " + tool_result(rng, 30)},
            ]
            continue
        call = r["calls"][0]
        messages += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": call["name"], "arguments": call["arguments"]},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call["id"], "content": tool_result(rng, a.result_tokens)},
        ]
    return out


def pct(xs: list[float], q: float) -> Optional[float]:
    xs = sorted(x for x in xs if x is not None)
    return None if not xs else round(1000 * xs[min(len(xs) - 1, int(q * len(xs)))], 1)


async def harness(url: str, a: argparse.Namespace) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        await one_round(client, url, [{"role": "user", "content": "warm up"}], 8)
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(agent(client, url, k, a) for k in range(a.agents)))
        wall = time.perf_counter() - t0
    every = [judge(r, a.opener_ids) for run in runs for r in run if not r.get("error")]
    per_k = lambda key: round(1000 * sum(v[key] for v in every) / max(1, len(every)), 1)  # noqa: E731
    rounds = []
    for i in range(a.rounds):
        rs = [r[i] for r in runs if i < len(r)]
        ok = [r for r in rs if not r.get("error")]
        rounds.append(
            {
                "round": i + 1,
                "ttft_p50_ms": pct([r["ttft"] for r in ok], 0.5),
                "ttft_p90_ms": pct([r["ttft"] for r in ok], 0.9),
                "prompt_tokens_p50": sorted(r["prompt_tokens"] or 0 for r in ok)[len(ok) // 2] if ok else None,
                "cached_tokens_p50": sorted(r["cached_tokens"] or 0 for r in ok)[len(ok) // 2] if ok else None,
                "tool_calls": sum(1 for r in ok if r["finish"] == "tool_calls"),
                "requests": len(rs),
                "finish_reasons": {f: sum(1 for r in ok if r["finish"] == f) for f in {r["finish"] for r in ok}},
                "errors": [r["error"] for r in rs if r.get("error")][:2],
            }
        )
    quality = {
        "rounds": len(every),
        "calls": sum(len(r["calls"]) for run in runs for r in run if not r.get("error")),
        "malformed_per_1000_rounds": per_k("malformed"),
        "lost_per_1000_rounds": per_k("lost"),
        "cut_by_max_tokens_per_1000_rounds": per_k("cut"),
    }
    return {"wall_s": round(wall, 2), "quality": quality, "per_round": rounds}


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    presets = list(report["results"])
    fig, axes = plt.subplots(1, len(presets), figsize=(6 * len(presets), 4), squeeze=False)
    for ax, preset in zip(axes[0], presets):
        for name, res in report["results"][preset].items():
            if "per_round" not in res:
                continue
            ys = [r["ttft_p50_ms"] for r in res["per_round"]]
            ax.plot(range(1, len(ys) + 1), ys, marker="o", label=f"{name} (wall {res['wall_s']:.0f} s)")
        ax.set_title(f"{preset}: TTFT p50 per round ({report['config']['agents']} agents)", fontsize=10)
        ax.set_xlabel("round")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Optional[list[str]] = None) -> None:
    a = parse_args(argv)
    logs = a.out / "logs"
    a.out.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "agents",
        "started": now_iso(),
        "machine": machine(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "note": "2 shared CPU cores, random-weight checkpoints: noisy; compare sides of one run only",
        "results": {},
    }
    for preset in a.presets:
        model = long_context(ensure_model(None, preset, a.seed))
        a.bias = marker_bias(model, a.marker_bias)
        a.opener_ids = set(marker_ids(model).values()) - {marker_ids(model)["<"]}
        report["results"][preset] = {}
        grammars = a.grammar if a.tool_choice == "auto" else ["on"]
        for mode, cache_side, grammar_side in ((m, c, g) for m in a.modes for c in a.caches for g in grammars):
            cache, grammar = cache_side == "on", grammar_side == "on"
            name = f"{mode}{'+cache' if cache else '-nocache'}" + ("" if grammar else "-raw")
            print(f"{preset} {name} ...", flush=True)
            url, procs = start(mode, model, cache, a, logs, grammar)
            try:
                for s in procs:
                    s.wait_ready(300)
                res = asyncio.run(harness(url, a))
            finally:
                for s in reversed(procs):
                    s.stop()
            report["results"][preset][name] = res
            write_json(report, a.out / "agents.json")  # after every side: a cut-short run keeps what it measured
            print(
                f"  wall {res['wall_s']} s; TTFT p50 per round (ms): "
                f"{[r['ttft_p50_ms'] for r in res['per_round']]}; tool calls "
                f"{sum(r['tool_calls'] for r in res['per_round'])}/{sum(r['requests'] for r in res['per_round'])}; "
                f"{res['quality']}",
                flush=True,
            )
    a.out.mkdir(parents=True, exist_ok=True)
    write_json(report, a.out / "agents.json")
    plot(report, a.out / "agents.png")
    print(f"wrote {a.out / 'agents.json'} and {a.out / 'agents.png'}")


if __name__ == "__main__":
    sys.exit(main())
