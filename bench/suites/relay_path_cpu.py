"""CPU of the router's per-token relay path in Python, without sockets: the part of a relayed
token that is the router's own code, measured the same way for this tree and for another commit.

For each of `--streams` streams: uvicorn's httptools response cycle (its head sent, a transport
that drops what it is given), the stream client's connection and answer with the relay's sink,
a `Resume` that knows the stream's head. One token event per stream, round after round, goes in
at the connection's `on_body` and out at the transport: `on_body` -> sink -> plain-delta reading
-> outlet -> client write. CPU time (process time) per token, best of 5; the kernel's share of a
token (the socket read and write) and the event loop's are not in it. Each router runs in its
own process, alternately, `--rounds` times.

    python -m bench.suites.relay_path_cpu [--base-ref main] [--streams 1024] [--rounds 3]
        [--out bench/results/relay] [--tag=-NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import RESULTS, ROOT, module_argv, module_env

ME = "bench.suites.relay_path_cpu"


async def _measure(streams: int, rounds: int = 50) -> float:
    import logging

    from uvicorn.protocols.http.flow_control import FlowControl
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    from dsv4_router import relay
    from dsv4_router import router as R
    from dsv4_router.migration import Resume
    from dsv4_router.stall import Watched
    from dsv4_router.stream_client import StreamResponse, _Conn

    class Wire:  # the client's connection: drops what is written
        def write(self, data: bytes) -> None:
            pass

        def is_closing(self) -> bool:
            return False

    log = logging.getLogger(ME)
    feeds, records = [], []
    for i in range(streams):
        wire = Wire()
        scope = {"type": "http", "method": "POST"}
        cycle = RequestResponseCycle(
            scope, wire, FlowControl(wire), log, log, False, [], asyncio.Event(), False, True, id
        )
        await cycle.send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
        )
        rid = f"chatcmpl-{i:032x}"
        st = Resume(rid, {"stream": True}, stream=True)
        st.head = (
            b'data: {"id": "%s", "object": "chat.completion.chunk", "created": 1700000000, "model": "stub", "choices": ['
            % rid.encode()
        )
        event = (
            st.head
            + b'{"index": 0, "finish_reason": null, "logprobs": null, "delta": {"content": "tok "}, "token_ids": [7]}]}\n\n'
        )
        outlet = relay.Outlet()
        outlet.send = cycle.send
        if hasattr(relay, "raw_body"):  # what the relay's stream loop sets once the head is out
            outlet.raw = relay.raw_body(cycle.send)
        conn = _Conn(("127.0.0.1", 1), None)
        conn.resp = StreamResponse(conn, 60.0)
        conn.resp.sink = R._direct(st, outlet, Watched((), lambda w: None))
        feeds.append((conn, event))
        records.append(st)
    best = float("inf")
    for _ in range(5):
        for st in records:
            st.tokens.clear()
            st.choice_tokens.clear()
        t0 = time.process_time()
        for _ in range(rounds):
            for conn, event in feeds:
                conn.on_body(event)
        best = min(best, (time.process_time() - t0) / (rounds * streams))
    assert all(not conn.resp._chunks for conn, _ in feeds), "the sink refused a plain event"
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-ref", default="main")
    ap.add_argument("--streams", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "relay"))
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="relay-path-base-"))
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", args.base_ref, "router/dsv4_router", "cli/dsv4_cli", "wire/dsv4_wire"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.base_ref], check=True, capture_output=True, text=True
    ).stdout.strip()
    runs = []
    for rnd in range(args.rounds):
        for kind in ("base", "tree"):
            env = module_env()
            if kind == "base":  # the other commit's router packages first on the path
                env["PYTHONPATH"] = os.pathsep.join(
                    [*(str(base / d) for d in ("router", "wire", "cli")), env.get("PYTHONPATH", "")]
                )
            out = subprocess.run(
                [*module_argv(ME, "one", "--streams", args.streams)],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            us = float(out.strip().splitlines()[-1])
            runs.append({"router": kind, "round": rnd, "us_per_token": us})
            print(json.dumps(runs[-1]), flush=True)
    best = {k: min(r["us_per_token"] for r in runs if r["router"] == k) for k in ("base", "tree")}
    result = {
        "what": "CPU of the router's per-token relay path in Python, no sockets (bench/suites/relay_path_cpu.py)",
        "base_ref": f"{args.base_ref} ({commit})",
        "streams": args.streams,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "shared": True},
        "runs": runs,
        "best_us_per_token": best,
        "tree_over_base": best["tree"] / best["base"],
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"relay-path-cpu{args.tag}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(best), f"tree/base {result['tree_over_base']:.2f}", f"wrote {path}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "one":
        ap = argparse.ArgumentParser()
        ap.add_argument("--streams", type=int, default=1024)
        a = ap.parse_args(sys.argv[2:])
        print(f"{asyncio.run(_measure(a.streams)):.4f}")
    else:
        main()
