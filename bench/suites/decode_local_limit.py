"""`dsv4 bench decode-local-limit`: what `--decode-local-prefill N` trades, to choose its default.

A PD decode that holds a conversation (prompt + answer) serves the next round itself when the round
adds at most N tokens: it prefills that tail between its running streams' decode steps. The other
way, prefill recomputes the previous answer and the tail and ships every page of the conversation.
For tails of T tokens on a conversation of --context tokens with a --answer-len answer, in-process
on one engine (decode's local path is the monolithic engine's own scheduler path):

- `local_ttft_ms`: the round's time to first token served where the conversation lives, while
  --streams other requests decode on the same engine;
- `streams_gap_ms_max` / `streams_delay_ms`: what those streams pay: their longest gap between
  tokens while the round prefills, and the time added to them in all (steps with the tail's chunks
  minus as many plain decode steps);
- `via_prefill_ms`: what a prefill engine holding the previous prompt (not the answer) computes for
  the same round alone (answer + tail), before any transfer; `moved_bytes`: the pages that way
  ships (prompt + answer + tail, plus one slot row), which the local path does not move at all.

Writes OUT/decode_local_limit.json and .png (default bench/results/decode_local_limit/).

    python -m bench.suites.decode_local_limit [--tails 64,256,1024,2048,4096] [--quick]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Optional

from bench.harness.checkpoints import RESULTS, ensure_model
from bench.harness.report import machine, now_iso, pyplot, write_json


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="v4-tiny-long")
    p.add_argument("--context", type=int, default=1536, help="tokens of the conversation before the answer")
    p.add_argument("--answer-len", type=int, default=120)
    p.add_argument("--tails", default="64,256,1024,2048")
    p.add_argument("--streams", type=int, default=4, help="requests decoding on the engine meanwhile")
    p.add_argument("--step-tokens", type=int, default=1024, help="--max-num-batched-tokens")
    p.add_argument("--repeats", type=int, default=1, help="per tail; the best counts")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS / "decode_local_limit")
    a = p.parse_args(argv)
    if a.quick:
        a.preset, a.context, a.answer_len, a.tails, a.streams, a.repeats = "v4-tiny", 256, 32, "32,128", 2, 1
    return a


def _engine(model: Path, a):
    from dsv4_engine.engine import Engine
    from dsv4_engine.engine_args import EngineArgs

    return Engine(
        EngineArgs(
            model=str(model),
            role="mono",
            device="cpu",
            kernel_backend="cpu",
            kv_memory_gb=1.0,
            max_num_seqs=a.streams + 2,
            max_num_batched_tokens=a.step_tokens,
            served_model_name="m",
        )
    )


class _Req:
    def __init__(self, eng, rid: str, prompt: list[int], n: int):
        from dsv4_engine.sampling_params import SamplingParams
        from dsv4_engine.sequence import Sequence

        self.tokens: list[int] = []
        self.times: list[float] = []
        self.done = False
        self.cached = 0
        self.t0 = time.perf_counter()

        def sink(out) -> None:
            now = time.perf_counter()
            for t in out.token_ids:
                self.tokens.append(t)
                self.times.append(now)
            self.done = self.done or out.finished
            self.cached = max(self.cached, out.cached_tokens or 0)

        eng.submit(
            Sequence(
                rid=rid,
                prompt_ids=list(prompt),
                params=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                sink=sink,
            )
        )


def _run(eng, req: _Req) -> _Req:
    while not req.done:
        eng.step()
    return req


def measure(a, model: Path) -> dict:
    rng = random.Random(0)
    vocab = 120
    ids = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    local, pre = _engine(model, a), _engine(model, a)
    context = ids(a.context)
    answer = _run(local, _Req(local, "r1", context, a.answer_len)).tokens  # decode holds prompt + answer
    _run(pre, _Req(pre, "p1", context, 1))  # prefill holds the prompt only
    pool = local.pool
    row = sum(pool.bytes_per_request().values())
    rows = []
    for tail in [int(x) for x in a.tails.split(",")]:
        best: Optional[dict] = None
        for rep in range(a.repeats):
            prompt = context + answer + ids(tail)
            streams = [_Req(local, f"s{tail}-{rep}-{i}", ids(64), 100_000) for i in range(a.streams)]
            while not all(len(s.tokens) >= 4 for s in streams):
                local.step()
            plain = []  # plain decode steps of the streams, the baseline
            for _ in range(6):
                t = time.perf_counter()
                local.step()
                plain.append(time.perf_counter() - t)
            round_ = _Req(local, f"round{tail}-{rep}", prompt, 1)
            steps = []
            while not round_.done:
                t = time.perf_counter()
                local.step()
                steps.append(time.perf_counter() - t)
            ttft = (round_.times[0] - round_.t0) if round_.times else None
            gaps = [
                b - x for s in streams for x, b in zip(s.times, s.times[1:]) if x >= round_.t0 - 1e-3
            ]  # gaps since the round arrived
            for i in range(a.streams):
                local.abort(f"s{tail}-{rep}-{i}")
            for _ in range(3):
                local.step()
            base = statistics.median(plain)
            # prefill never saw the answer: the same work as computing it, without the earlier
            # runs' answers cached there (an answer of the same length, other tokens)
            via_prompt = context + ids(len(answer)) + prompt[len(context) + len(answer) :]
            via = _run(pre, _Req(pre, f"via{tail}-{rep}", via_prompt, 1))
            got = {
                "tail_tokens": tail,
                "local_ttft_ms": round(ttft * 1e3, 1),
                "local_cached_tokens": round_.cached,
                "via_cached_tokens": via.cached,
                "round_steps": len(steps),
                "plain_step_ms": round(base * 1e3, 1),
                "streams_gap_ms_max": round(max(gaps) * 1e3, 1) if gaps else None,
                "streams_delay_ms": round((sum(steps) - base * len(steps)) * 1e3, 1),
                "via_prefill_ms": round((via.times[0] - via.t0) * 1e3, 1),
                "via_prefill_tokens": a.answer_len + tail,
                "moved_bytes": -(-len(prompt) // pool.page_size) * pool.page_nbytes + row,
            }
            if best is None or got["local_ttft_ms"] < best["local_ttft_ms"]:
                best = got
        rows.append(best)
        print(best, flush=True)
    return {"rows": rows, "page_size": pool.page_size, "page_bytes": pool.page_nbytes, "slot_row_bytes": row}


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    rows = report["rows"]
    x = [r["tail_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [r["local_ttft_ms"] for r in rows], "o-", label="round served by decode: TTFT")
    ax.plot(x, [r["via_prefill_ms"] for r in rows], "s-", label="via prefill: compute alone (no transfer)")
    ax.plot(x, [r["streams_delay_ms"] for r in rows], "^-", label="added to each running stream")
    ax.plot(x, [r["streams_gap_ms_max"] for r in rows], "v--", label="running streams' longest gap")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens the round adds (tool result + turn)")
    ax.set_ylabel("ms")
    ax.set_title(
        f"{report['preset']}: {report['context']} + {report['answer_len']}-token conversation, "
        f"{report['streams']} streams decoding",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Optional[list[str]] = None) -> None:
    a = parse_args(argv)
    model = ensure_model(None, a.preset, 0)
    report = {
        "bench": "decode_local_limit",
        "date": now_iso(),
        "machine": machine(),
        "preset": a.preset,
        "context": a.context,
        "answer_len": a.answer_len,
        "streams": a.streams,
        "step_tokens": a.step_tokens,
        "repeats": a.repeats,
        **measure(a, model),
    }
    a.out.mkdir(parents=True, exist_ok=True)
    write_json(report, a.out / "decode_local_limit.json")
    plot(report, a.out / "decode_local_limit.png")
    print(f"wrote {a.out / 'decode_local_limit.json'}")


if __name__ == "__main__":
    main()
