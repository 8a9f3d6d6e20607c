"""The channel between `dsv4 serve`'s HTTP process and its engine core, measured alone.

A child process echoes what it gets on the same kind of socket pair + `Connection` framing the
server uses; the parent times round trips of the real messages (`dsv4_serve.core_messages`):
one engine step's outputs for 1, 8, 32 and 64 running requests (one token each, with and
without logprobs), an ADD of a 128- and a 4096-token prompt, and a small RPC. Beside it, what
encoding the 32-row step costs in marshal (what we use), pickle and json.

    python -m bench.suites.channel_bench [--iters 2000] [--quick] [--out bench/results]
Writes OUT/channel.json; best (lowest) p50 of --repeats runs.
"""

from __future__ import annotations

import argparse
import json
import pickle
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from bench import RESULTS
from typing import Optional

from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.request_output import RequestOutput
from dsv4_serve import core_messages as m

ECHO = (
    "import sys; from multiprocessing.connection import Connection; c = Connection(int(sys.argv[1]))\n"
    "try:\n    while True:\n        c.send_bytes(c.recv_bytes())\nexcept (EOFError, OSError):\n    pass\n"
)


def step_message(rows: int, logprobs: bool) -> m.Out:
    lp = [{"token_id": 1234, "logprob": -0.5, "top": [[1234, -0.5], [77, -1.25]]}] if logprobs else None
    return m.Out(
        [
            m.output_row(k, RequestOutput(f"cmpl-{k:032x}", [1234], " word", False, None, None, 500, 128, 17, lp))
            for k in range(rows)
        ]
    )


def messages() -> dict[str, m.Message]:
    p = SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, seed=1, stop=["\n\n"])
    out = {f"step_{n}_rows": step_message(n, False) for n in (1, 8, 32, 64)}
    out["step_32_rows_logprobs"] = step_message(32, True)
    out["add_128_tokens"] = m.add_msg(1, "cmpl-x", list(range(1000, 1128)), p, None, False, 1.0)
    out["add_4096_tokens"] = m.add_msg(1, "cmpl-x", list(range(1000, 5096)), p, None, False, 1.0)
    out["rpc_state"] = m.Call(7, "state", None)
    return out


def round_trips(conn: Connection, msg: m.Message, iters: int) -> list[float]:
    """Seconds per round trip: encode, send, child echoes, receive, decode."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        conn.send_bytes(m.dumps(msg))
        m.loads(conn.recv_bytes())
        times.append(time.perf_counter() - t0)
    return times


def p50(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def encode_costs(msg: m.Message, iters: int) -> dict:
    plain = json.loads(json.dumps(msg))  # json has no tuples; same content
    out = {}
    for name, enc, dec in (
        ("marshal", m.dumps, m.loads),
        ("pickle", pickle.dumps, pickle.loads),
        ("json", lambda x: json.dumps(x).encode(), json.loads),
    ):
        data = enc(msg if name != "json" else plain)
        t0 = time.perf_counter()
        for _ in range(iters):
            dec(enc(msg if name != "json" else plain))
        out[name] = {"bytes": len(data), "encode_decode_us": round((time.perf_counter() - t0) / iters * 1e6, 2)}
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="at most 200 iterations, 1 repeat")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.iters, a.repeats = min(a.iters, 200), 1
    out_dir = a.out or (RESULTS / "quick" if a.quick else RESULTS)
    ours, theirs = socket.socketpair()
    child = subprocess.Popen([sys.executable, "-c", ECHO, str(theirs.fileno())], pass_fds=(theirs.fileno(),))
    theirs.close()
    conn = Connection(ours.detach())
    report: dict = {"benchmark": "channel", "iters": a.iters, "repeats": a.repeats, "round_trip": {}}
    try:
        for name, msg in messages().items():
            runs = [round_trips(conn, msg, a.iters) for _ in range(a.repeats)]
            best = min(runs, key=p50)
            report["round_trip"][name] = {
                "bytes": len(m.dumps(msg)),
                "p50_us": round(p50(best) * 1e6, 1),
                "p99_us": round(sorted(best)[int(len(best) * 0.99) - 1] * 1e6, 1),
            }
            print(
                f"{name:24s} {report['round_trip'][name]['bytes']:7d} B  round trip p50 "
                f"{report['round_trip'][name]['p50_us']:8.1f} us  p99 {report['round_trip'][name]['p99_us']:8.1f} us"
            )
        report["encoding_step_32_rows"] = encode_costs(step_message(32, False), a.iters)
        for name, v in report["encoding_step_32_rows"].items():
            print(f"encode+decode of a 32-row step, {name:8s} {v['bytes']:6d} B  {v['encode_decode_us']:7.1f} us")
    finally:
        conn.close()
        child.kill()
        child.wait()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "channel.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out_dir / 'channel.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
