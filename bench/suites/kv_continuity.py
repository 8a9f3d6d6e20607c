"""`dsv4 bench kv-continuity`: does round N+1 of a conversation find round N's prompt *and answer*?

--conversations conversations at once, --rounds rounds each, --answer-tokens-token answers
(ignore_eos), a --turn-tokens new turn per round, on real servers (mono; PD = router + prefill +
decode over NIXL, with and without `--decode-local-prefill`). Two APIs: completions with token ids
(the next prompt is the previous prompt + the answer's ids + a new turn) and chat (the client
re-sends the answer's text). Per round: the cached share (cached_tokens over the previous round's
prompt + answer), and in PD the KV bytes moved prefill -> decode (prefill's
dsv4:kv_transfer_bytes_total) against the new tokens' own KV (their paged state plus one slot
row per request). Greedy answers of every side are compared with mono's. Writes
OUT/kv_continuity.json and OUT/kv_continuity.png.

    python -m bench.suites.kv_continuity [--preset v4-tiny-long] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

from bench.harness.checkpoints import RESULTS, ensure_model
from bench.harness.procs import Server, free_port
from bench.harness.report import machine, now_iso, pyplot, write_json

WORDS = (
    "file line error build test pass fail module import value return object list index count path "
    "config server request token cache page decode prefill router agent round result output"
).split()
SIDES = {  # name -> (mode, decode's --decode-local-prefill, chat answer memo)
    "mono": ("mono", 0, True),
    "pd": ("pd", 512, True),
    # before this work: chat answers tokenized again; decode without a cache, so every round is
    # prefilled (the previous answer again) and shipped whole
    "mono-before": ("mono", 0, False),
    "pd-before": ("pd", 0, False),
}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="v4-tiny-long")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--answer-tokens", type=int, default=120)
    p.add_argument("--first-tokens", type=int, default=512, help="first prompt, in tokens")
    p.add_argument("--turn-tokens", type=int, default=64, help="new turn per round, in tokens")
    p.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES))
    p.add_argument("--apis", nargs="+", default=["ids", "chat"], choices=["ids", "chat"])
    p.add_argument("--kv-pages", type=int, default=1024)
    p.add_argument("--out", type=Path, default=None, help="results folder (default bench/results/kv_continuity)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="2 conversations x 2 rounds of 16-token answers, ids only")
    a = p.parse_args(argv)
    if a.quick:
        a.conversations, a.rounds, a.answer_tokens, a.first_tokens, a.turn_tokens = 2, 2, 16, 64, 16
        a.apis = ["ids"]
    a.out = a.out or (RESULTS / "kv_continuity" / ("quick" if a.quick else ""))
    return a


def start(side: str, model: Path, a: argparse.Namespace, logs: Path) -> tuple[str, list[Server], Optional[str]]:
    """Servers of one side: (the URL clients use, every process, prefill's URL in PD)."""
    mode, local, memo = SIDES[side]
    common = ["--model", model, "--kv-pages", a.kv_pages, "--max-num-seqs", 16, "--served-model-name", "bench"]
    common += [] if memo else ["--chat-answer-memo", 0]
    if mode == "mono":
        port = free_port()
        s = Server.dsv4(f"{side}-mono", ["serve", *common, "--port", port], port, logs)
        return s.url, [s], None
    pp, bp, dp, rp = (free_port() for _ in range(4))
    prefill = Server.dsv4(
        f"{side}-prefill", ["serve", *common, "--role", "prefill", "--port", pp, "--bootstrap-port", bp], pp, logs
    )
    extra = ["--decode-local-prefill", local]  # 0 stated: the default is on
    decode = Server.dsv4(f"{side}-decode", ["serve", *common, "--role", "decode", "--port", dp, *extra], dp, logs)
    for s in (prefill, decode):
        s.wait_ready(300)
    router = Server.dsv4(
        f"{side}-router",
        ["router", "--prefill", prefill.url, "--decode", decode.url, "--port", rp, "--health-interval", "1"],
        rp,
        logs,
    )
    return router.url, [prefill, decode, router], prefill.url


def moved_bytes(client: httpx.Client, prefill: Optional[str]) -> float:
    if prefill is None:
        return 0.0
    text = client.get(f"{prefill}/metrics").text
    return sum(float(v) for v in re.findall(r"^dsv4:kv_transfer_bytes_total\{[^}]*\} (\S+)$", text, re.M))


def words(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, tokens // 3)))  # ~3 tokens a word with its space


async def ask(client: httpx.AsyncClient, url: str, api: str, convo, a: argparse.Namespace) -> dict:
    common = {"model": "bench", "max_tokens": a.answer_tokens, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    if api == "ids":
        r = await client.post(f"{url}/v1/completions", json={**common, "prompt": convo, "return_token_ids": True})
    else:
        r = await client.post(f"{url}/v1/chat/completions", json={**common, "messages": convo})
    if r.status_code != 200:
        raise RuntimeError(f"{api} request answered {r.status_code}: {r.text[:300]}")
    body = r.json()
    usage, choice = body["usage"], body["choices"][0]
    return {
        "latency_ms": round((time.perf_counter() - t0) * 1000, 1),
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
        "answer_ids": choice.get("token_ids"),
        "answer_text": choice["message"]["content"] if api == "chat" else choice["text"],
    }


async def conversations(url: str, prefill: Optional[str], api: str, a: argparse.Namespace, costs: dict) -> dict:
    rng = random.Random(a.seed)
    if api == "ids":
        convos = [[rng.randrange(5, 250) for _ in range(a.first_tokens)] for _ in range(a.conversations)]
    else:
        convos = [
            [{"role": "system", "content": f"agent {k}: " + words(rng, a.first_tokens)}]
            + [{"role": "user", "content": words(rng, a.turn_tokens)}]
            for k in range(a.conversations)
        ]
    rounds, answers, prev = [], [[] for _ in convos], [None] * len(convos)
    with httpx.Client(timeout=30) as sync:
        async with httpx.AsyncClient(timeout=900) as client:
            for rnd in range(a.rounds):
                before = moved_bytes(sync, prefill)
                res = await asyncio.gather(*(ask(client, url, api, c, a) for c in convos))
                moved = moved_bytes(sync, prefill) - before
                shares, new_tokens = [], 0
                for k, r in enumerate(res):
                    held = prev[k]
                    if held is not None:
                        shares.append(r["cached_tokens"] / held)
                    new_tokens += r["prompt_tokens"] - (held or 0)
                    prev[k] = r["prompt_tokens"] + r["completion_tokens"]
                    answers[k].append(r["answer_ids"] or r["answer_text"])
                    if api == "ids":
                        convos[k] = convos[k] + r["answer_ids"] + [rng.randrange(5, 250) for _ in range(a.turn_tokens)]
                    else:
                        convos[k] = convos[k] + [
                            {"role": "assistant", "content": r["answer_text"]},
                            {"role": "user", "content": words(rng, a.turn_tokens)},
                        ]
                own = new_tokens * costs["per_token"] + len(res) * costs["per_request"]
                rounds.append(
                    {
                        "round": rnd + 1,
                        "cached_share": round(sum(shares) / len(shares), 4) if shares else None,
                        "cached_shares": [round(s, 4) for s in shares],
                        "prompt_tokens": [r["prompt_tokens"] for r in res],
                        "cached_tokens": [r["cached_tokens"] for r in res],
                        "latency_ms_p50": sorted(r["latency_ms"] for r in res)[len(res) // 2],
                        "new_tokens": new_tokens,
                        "kv_bytes_moved": moved,
                        "new_tokens_own_kv_bytes": own,
                        "moved_over_own": round(moved / own, 4) if prefill is not None and own else None,
                    }
                )
                print(f"    round {rnd + 1}: {rounds[-1]['cached_share']} cached, {moved:.0f} B moved", flush=True)
    later = [r["cached_share"] for r in rounds[1:] if r["cached_share"] is not None]
    return {
        "per_round": rounds,
        "cached_share_rounds_2_on": round(sum(later) / len(later), 4) if later else None,
        "moved_over_own_rounds_2_on": (
            round(max(r["moved_over_own"] for r in rounds[1:]), 4) if prefill is not None and rounds[1:] else None
        ),
        "answers": answers,
    }


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    apis = report["config"]["apis"]
    fig, axes = plt.subplots(1, len(apis), figsize=(6 * len(apis), 4), squeeze=False)
    for ax, api in zip(axes[0], apis):
        for side, res in report["results"].items():
            if api not in res:
                continue
            rs = res[api]["per_round"][1:]
            ax.plot([r["round"] for r in rs], [r["cached_share"] for r in rs], marker="o", label=side)
        ax.axhline(0.9, color="grey", lw=0.8, ls="--")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{api}: cached share of previous prompt + answer", fontsize=10)
        ax.set_xlabel("round")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Optional[list[str]] = None) -> None:
    a = parse_args(argv)
    logs = a.out / "logs"
    a.out.mkdir(parents=True, exist_ok=True)
    model = ensure_model(None, a.preset, a.seed)
    report = {
        "benchmark": "kv_continuity",
        "started": now_iso(),
        "machine": machine(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "results": {},
    }
    for side in a.sides:
        print(f"{side} ...", flush=True)
        url, procs, prefill = start(side, model, a, logs)
        try:
            for s in procs:
                s.wait_ready(300)
            loads = httpx.get(f"{procs[0].url}/v1/loads", timeout=30).json()
            costs = {
                "per_token": sum(loads["kv_state_bytes_per_token"].values()),
                "per_request": sum(loads["kv_state_bytes_per_request"].values()),
            }
            report["results"][side] = {"kv_state_bytes": costs}
            for api in a.apis:
                print(f"  {api}", flush=True)
                report["results"][side][api] = asyncio.run(conversations(url, prefill, api, a, costs))
        finally:
            for s in reversed(procs):
                s.stop()
        write_json(report, a.out / "kv_continuity.json")  # after every side: a cut-short run keeps it
    mono = report["results"].get("mono", {})
    for side, res in report["results"].items():
        for api in a.apis:
            if api in res and api in mono:
                res[api]["answers_equal_mono"] = res[api]["answers"] == mono[api]["answers"]
    for res in report["results"].values():
        for api in a.apis:
            if api in res:
                res[api].pop("answers")
    write_json(report, a.out / "kv_continuity.json")
    plot(report, a.out / "kv_continuity.png")
    print(f"wrote {a.out / 'kv_continuity.json'} and {a.out / 'kv_continuity.png'}")


if __name__ == "__main__":
    sys.exit(main())
