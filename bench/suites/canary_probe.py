"""Canary probe cost: how long the probe runs and what it adds to the canary engine.

Real processes on the tiny model: one prefill, two decodes, the router. For each probe setting
the probe runs pinned to decode-0 (out of rotation, as in a rollout) while a steady client sends
short requests through the router (decode-1 serves them); measured: the probe's wall time, the
requests, prompt and generated tokens it put on the canary (the canary's own counters), its
figures, and the steady client's latency during the probe against before it. Then the same probe
against a decode armed with stall_long_context: how long until the verdict says fail.

    python -m bench.suites.canary_probe [--out bench/results/canary_probe.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
from bench import RESULTS

from bench.harness.procs import Server, free_port, load_average  # noqa: E402

from dsv4_operator.canary.conversation import ConversationShape  # noqa: E402
from dsv4_operator.canary.probe import ProbeSettings, run_probe  # noqa: E402
from dsv4_operator.canary.verdict import judge  # noqa: E402

SETTINGS = {
    "short": ProbeSettings(
        ConversationShape(growth_tokens=48, context_share=0.25),
        concurrency=1,
        duration_s=10,
        request_timeout_s=5,
        settle_s=5,
    ),
    "default-shape": ProbeSettings(ConversationShape(), concurrency=2, duration_s=20, request_timeout_s=5, settle_s=5),
}


def counters(url: str) -> dict:
    return httpx.get(f"{url}/v1/loads", timeout=5).json().get("counters", {})


class Steady:
    def __init__(self, url: str):
        self.url, self.lat, self.err, self.stop = url, [], 0, threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                r = httpx.post(
                    f"{self.url}/v1/completions",
                    json={"prompt": "hello there", "max_tokens": 8, "temperature": 0},
                    timeout=60,
                )
                if r.status_code == 200:
                    self.lat.append((time.monotonic(), time.monotonic() - t0))
                else:
                    self.err += 1
            except httpx.HTTPError:
                self.err += 1
            time.sleep(0.2)

    def between(self, a: float, b: float) -> list[float]:
        return [x for t, x in self.lat if a <= t <= b]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS / "canary_probe.json"))
    args = ap.parse_args()
    from dsv4_engine.checkpoint import init_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="canarybench-"))
    model = tmp / "tiny"
    init_checkpoint(model, preset="tiny", seed=0)
    p, b, d0, d1, d2, r = (free_port() for _ in range(6))
    common = ["serve", "--model", model, "--served-model-name", "m", "--kv-pages", 256, "--page-size", 16]
    servers = [
        Server.dsv4("prefill", [*common, "--role", "prefill", "--port", p, "--bootstrap-port", b], p, tmp),
        Server.dsv4("decode0", [*common, "--role", "decode", "--port", d0], d0, tmp),
        Server.dsv4("decode1", [*common, "--role", "decode", "--port", d1], d1, tmp),
        Server.dsv4(
            "decode-stall",
            [
                *common,
                "--role",
                "decode",
                "--port",
                d2,
                "--enable-fault-injection",
                "--arm-fault",
                "stall_long_context:tokens=150",
            ],
            d2,
            tmp,
        ),
    ]
    urls = {s.name: s.url for s in servers}
    servers.append(
        Server.dsv4(
            "router",
            [
                "router",
                "--prefill",
                urls["prefill"],
                "--decode",
                urls["decode0"],
                "--decode",
                urls["decode1"],
                "--decode",
                urls["decode-stall"],
                "--port",
                r,
                "--health-interval",
                "0.5",
            ],
            r,
            tmp,
        )
    )
    router = servers[-1].url
    out = {
        "machine": platform.processor() or platform.machine(),
        "model": "tiny",
        "settings": {},
        "runs": {},
        "load_average_at_start": load_average(),
        "note": "2 shared CPU cores, other sessions' tests running: absolute times are slow and noisy",
    }
    try:
        for s in servers:
            s.wait_ready(180)
        time.sleep(2)
        for name in ("decode0", "decode-stall"):  # canaries: out of the normal rotation
            httpx.post(
                f"{router}/admin/workers", json={"url": urls[name], "role": "decode", "canary": True}, timeout=10
            ).raise_for_status()
        steady = Steady(router)
        time.sleep(8)
        for label, st in SETTINGS.items():
            out["settings"][label] = {
                "duration_s": st.duration_s,
                "concurrency": st.concurrency,
                "growth_tokens": st.shape.growth_tokens,
                "context_share": st.shape.context_share,
                "answer_tokens": st.shape.answer_tokens,
                "request_timeout_s": st.request_timeout_s,
            }
            before = counters(urls["decode0"])
            t0 = time.monotonic()
            figures, signals = asyncio.run(run_probe(router, urls["decode0"], "decode", st, pin=urls["decode0"]))
            wall = time.monotonic() - t0
            after = counters(urls["decode0"])
            base = steady.between(t0 - 8, t0)
            during = steady.between(t0, t0 + wall)
            verdict = judge(figures, None, signals)
            gen = after.get("generation_tokens", 0) - before.get("generation_tokens", 0)
            out["runs"][label] = {
                "probe_wall_s": round(wall, 2),
                "figures": figures.to_dict(),
                "verdict_passed": verdict.passed,
                "canary_extra_load": {
                    "requests": figures.requests,
                    "prompt_tokens": figures.prompt_tokens,
                    "generated_tokens": gen,
                    "generated_tokens_per_s": round(gen / wall, 2),
                    "prompt_tokens_per_s": round(figures.prompt_tokens / wall, 2),
                },
                "other_traffic_latency_s": {
                    "before_median": round(statistics.median(base), 4) if base else None,
                    "during_median": round(statistics.median(during), 4) if during else None,
                    "n_during": len(during),
                },
            }
            print(label, json.dumps(out["runs"][label]), flush=True)
            time.sleep(8)
        st = SETTINGS["default-shape"]
        t0 = time.monotonic()
        figures, signals = asyncio.run(run_probe(router, urls["decode-stall"], "decode", st, pin=urls["decode-stall"]))
        wall = time.monotonic() - t0
        stable = out["runs"]["default-shape"]["figures"]
        from dsv4_operator.canary.verdict import ProbeFigures

        verdict = judge(figures, ProbeFigures(**stable), signals)
        out["runs"]["stall_long_context"] = {
            "probe_wall_s": round(wall, 2),
            "figures": figures.to_dict(),
            "verdict_passed": verdict.passed,
            "reasons": list(verdict.reasons),
            "wedge_signal": signals.wedged,
        }
        print("stall", json.dumps(out["runs"]["stall_long_context"]), flush=True)
        steady.stop.set()
        steady.t.join(70)
        out["other_traffic_errors"] = steady.err
        out["other_traffic_requests"] = len(steady.lat)
        out["load_average_at_end"] = load_average()
    finally:
        for s in servers:
            s.stop()
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
