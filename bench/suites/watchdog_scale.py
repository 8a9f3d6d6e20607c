"""Scale benchmark of the wedge watchdog: scrape + detect for many engine pods per interval.

A separate server process simulates N engine pods, each on its own 127.0.0.1 port (as distinct
pod IPs would be), serving /metrics as prometheus_client writes it (our `dsv4:` names with
histograms, plus process/GC series; one in ten pods speaks SGLang's `sglang:` names with eight
TP ranks) and /v1/loads.  A few prefill pods are wedged (an inflight request that never
completes).  This process scrapes all of them every interval with the watchdog's own
scrape_all + Detector and measures its CPU time per pod per scrape and its RSS.

    python -m bench.suites.watchdog_scale [--pods 500] [--intervals 8] [--interval-s 5]

Writes bench/results/watchdog_scale.json.  Targets (issue 5): <= 1 ms CPU per pod per scrape,
RSS < 200 MB.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import time
from pathlib import Path
from bench import RESULTS, module_argv, module_env

WEDGED_EVERY = 50  # one pod in 50 is a wedged prefill
SGLANG_EVERY = 10  # one pod in 10 runs SGLang


# --- the simulated fleet (server process) -------------------------------------------------------


def _pod_kind(i: int) -> tuple[str, str, bool]:
    role = "prefill" if i % 2 == 0 else "decode"
    kind = "sglang" if i % SGLANG_EVERY == 3 else "builtin"
    wedged = role == "prefill" and kind == "builtin" and i % WEDGED_EVERY == 0
    return role, kind, wedged


class SimPod:
    """One engine's observable state, advancing with wall time."""

    def __init__(self, i: int, start: float):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.i, self.start = i, start
        self.role, self.kind, self.wedged = _pod_kind(i)
        self.rnd = random.Random(i)
        self.reg = CollectorRegistry()
        prefix = "sglang:" if self.kind == "sglang" else "dsv4:"
        if self.kind == "sglang":
            names = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"]
            self.label_sets = [("dsv4", self.role, str(r), "0", "0") for r in range(8)]
        else:
            names = ["role", "model_name"]
            self.label_sets = [(self.role, "dsv4")]

        def g(n):
            return Gauge(prefix + n, n, names, registry=self.reg)

        def c(n):
            return Counter(prefix + n, n, names, registry=self.reg)

        def h(n, buckets):
            return Histogram(prefix + n, n, names, registry=self.reg, buckets=buckets)

        lat = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.g = {
            n: g(n)
            for n in (
                "num_running_reqs",
                "num_queue_reqs",
                "num_prefill_inflight_queue_reqs",
                "num_decode_prealloc_queue_reqs",
                "num_decode_transfer_queue_reqs",
            )
        }
        self.g["bootstrap"] = g("num_prefill_bootstrap_queue_reqs")
        if self.kind == "sglang":
            self.g["max_total_num_tokens"] = g("max_total_num_tokens")
            self.g["num_used_tokens"] = g("num_used_tokens")
            self.h = {"xfer": h("kv_transfer_latency_ms", (1, 5, 10, 50, 100, 500, 1000))}
            self.c = {
                n: c(n)
                for n in (
                    "num_transfer_failed_reqs_total",
                    "num_bootstrap_failed_reqs_total",
                    "prompt_tokens_total",
                    "generation_tokens_total",
                    "num_requests_total",
                    "num_aborted_requests_total",
                )
            }
        else:
            self.g["age"] = g("prefill_inflight_oldest_age_seconds")
            self.g["kv_pages_free"] = g("kv_pages_free")
            self.g["kv_pages_total"] = g("kv_pages_total")
            self.c = {
                n: c(n)
                for n in (
                    "num_bootstrap_failed_reqs_total",
                    "num_transfer_failed_reqs_total",
                    "num_transfer_timeout_reqs_total",
                    "kv_transfers_completed_total",
                    "kv_transfer_bytes_total",
                    "prompt_tokens_total",
                    "generation_tokens_total",
                    "num_aborted_reqs_total",
                    "scheduler_loop_iterations_total",
                )
            }
            self.h = {"xfer": h("kv_transfer_latency_seconds", lat)}
        for n in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
            self.h[n] = h(n, lat)
        self.totals = {n: 0.0 for n in self.c}
        self.last = start

    def advance(self, now: float) -> dict:
        dt, self.last = max(now - self.last, 0.0), now
        up = now - self.start
        r = self.rnd
        prefill = self.role == "prefill"
        if self.wedged:
            inflight, age, xfers = 1 + int(up // 20), up + 1.0, 0
        else:
            inflight = r.randint(0, 4) if prefill else 0
            age, xfers = r.uniform(0.0, 2.0) if inflight else 0.0, int(dt * r.uniform(2, 8))
        vals = {
            "num_running_reqs": r.randint(0, 2) if prefill else r.randint(16, 64),
            "num_queue_reqs": r.randint(0, 8),
            "num_prefill_inflight_queue_reqs": inflight,
            "num_decode_prealloc_queue_reqs": 0 if prefill else r.randint(0, 4),
            "num_decode_transfer_queue_reqs": 0 if prefill else r.randint(0, 3),
            "bootstrap": r.randint(0, 2) if prefill else 0,
        }
        for lv in self.label_sets:
            for n, v in vals.items():
                self.g[n].labels(*lv).set(v)
        inc = {
            "prompt_tokens_total": dt * 4000 if prefill else 0.0,
            "generation_tokens_total": dt * (40 if prefill else 3000),
        }
        if self.kind == "sglang":
            self.g["max_total_num_tokens"].labels(*self.label_sets[0]).set(500_000)
            self.g["num_used_tokens"].labels(*self.label_sets[0]).set(r.randint(0, 400_000))
            inc["num_requests_total"] = xfers
        else:
            self.g["age"].labels(*self.label_sets[0]).set(age)
            self.g["kv_pages_free"].labels(*self.label_sets[0]).set(r.randint(0, 8192))
            self.g["kv_pages_total"].labels(*self.label_sets[0]).set(8192)
            inc.update(
                {
                    "kv_transfers_completed_total": xfers,
                    "kv_transfer_bytes_total": xfers * 3.5e7,
                    "scheduler_loop_iterations_total": dt * 200,
                }
            )
        for n, v in inc.items():
            if v:
                self.c[n].labels(*self.label_sets[0]).inc(v)
                self.totals[n] += v
        for _ in range(xfers):
            self.h["xfer"].labels(*self.label_sets[0]).observe(r.uniform(0.01, 0.5))
            self.h["e2e_request_latency_seconds"].labels(*self.label_sets[0]).observe(r.uniform(0.5, 20))
        return {"inflight": inflight, "age": age, "vals": vals}

    def loads(self, live: dict) -> dict:
        v = live["vals"]
        if self.kind == "sglang":
            return {
                "timestamp": "",
                "version": "0.5.x",
                "loads": [
                    {
                        "dp_rank": 0,
                        "num_running_reqs": v["num_running_reqs"],
                        "num_waiting_reqs": v["num_queue_reqs"],
                        "num_used_tokens": 1000,
                        "max_total_num_tokens": 500_000,
                        "disaggregation": {
                            "mode": self.role,
                            "prefill_bootstrap_queue_reqs": v["bootstrap"],
                            "prefill_inflight_queue_reqs": live["inflight"],
                            "decode_prealloc_queue_reqs": v["num_decode_prealloc_queue_reqs"],
                            "decode_transfer_queue_reqs": v["num_decode_transfer_queue_reqs"],
                        },
                    }
                ],
            }
        return {
            "role": self.role,
            "queues": {
                "waiting": v["num_queue_reqs"],
                "running": v["num_running_reqs"],
                "bootstrap": v["bootstrap"],
                "inflight": live["inflight"],
                "prealloc": v["num_decode_prealloc_queue_reqs"],
                "transfer": v["num_decode_transfer_queue_reqs"],
            },
            "prefill_inflight_oldest_age_seconds": live["age"],
            "kv_pages_free": 4096,
            "kv_pages_total": 8192,
            "counters": dict(self.totals),
        }


async def serve(n_pods: int) -> None:
    from aiohttp import web
    from prometheus_client import REGISTRY, generate_latest

    process_block = generate_latest(REGISTRY)  # process_*, python_gc_*, python_info: noise
    start = time.time()
    pods = [SimPod(i, start) for i in range(n_pods)]
    by_port: dict[int, SimPod] = {}
    live: dict[int, dict] = {}

    def pod_of(request) -> SimPod:
        return by_port[request.transport.get_extra_info("sockname")[1]]

    async def metrics(request):
        pod = pod_of(request)
        live[pod.i] = pod.advance(time.time())
        return web.Response(body=generate_latest(pod.reg) + process_block, content_type="text/plain", charset="utf-8")

    async def loads(request):
        pod = pod_of(request)
        state = live.get(pod.i) or pod.advance(time.time())
        return web.json_response(pod.loads(state))

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/loads", loads)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    ports = []
    for pod in pods:
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=64)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        by_port[port] = pod
        ports.append(port)
    print(json.dumps({"ports": ports}), flush=True)
    await asyncio.Event().wait()


# --- the watchdog side (measured process) -------------------------------------------------------


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _parse_cost_us(texts: dict) -> dict:
    """Per-scrape parse cost (build_sample) on captured real responses, no I/O."""
    from dsv4_operator.watchdog.signals import build_sample

    out = {}
    for kind, (metrics, loads) in texts.items():
        n = 300
        t0 = time.process_time()
        for _ in range(n):
            build_sample(0.0, "prefill", kind, metrics_text=metrics, loads=json.loads(loads))
        out[kind] = round((time.process_time() - t0) / n * 1e6, 1)
    return out


async def _fetch(client, url: str) -> str:
    if hasattr(client, "aclose"):  # httpx
        return (await client.get(url)).text
    async with client.get(url) as resp:
        return await resp.text()


async def measure(args) -> dict:
    if args.with_operator_deps:
        import kopf  # noqa: F401  (the operator process carries these)
        import kubernetes_asyncio  # noqa: F401
    from dsv4_operator.watchdog.detector import Detector, Wedged
    from dsv4_operator.watchdog.signals import ScrapeTarget
    from dsv4_operator.remediation.scrape import make_session, scrape_all

    rss_before = _rss_mb()

    server = subprocess.Popen(
        module_argv("bench.suites.watchdog_scale", "--serve", "--pods", args.pods),
        stdout=subprocess.PIPE,
        text=True,
        env=module_env(),
    )
    try:
        ports = json.loads(server.stdout.readline())["ports"]
        targets = []
        for i, port in enumerate(ports):
            role, kind, _ = _pod_kind(i)
            targets.append(ScrapeTarget(f"pod-{i}", f"http://127.0.0.1:{port}", role, kind))
        window = args.interval_s * 3  # short, so the wedged pods are detected within the run
        detector = Detector(window_s=window, failure_rate_threshold=0.5)
        if args.client == "httpx":  # for comparison: one shared httpx client
            import httpx

            pool = 2 * len(targets)
            client = httpx.AsyncClient(
                trust_env=False, limits=httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
            )
        else:
            client = make_session(args.concurrency)
        rounds = []
        next_at = time.monotonic()
        try:
            for _ in range(args.intervals):
                await asyncio.sleep(max(next_at - time.monotonic(), 0.0))
                next_at += args.interval_s
                c0, w0 = time.process_time(), time.perf_counter()
                samples = await scrape_all(targets, args.concurrency, args.timeout, client=client)
                c1 = time.process_time()
                verdicts = {k: detector.observe(k, s) for k, s in samples.items()}
                c2, w2 = time.process_time(), time.perf_counter()
                counts: dict[str, int] = {}
                for v in verdicts.values():
                    key = v.state + (f":{v.reason}" if hasattr(v, "reason") else "")
                    counts[key] = counts.get(key, 0) + 1
                rounds.append(
                    {
                        "cpu_ms_per_pod": (c2 - c0) * 1000 / len(targets),
                        "scrape_cpu_ms_per_pod": (c1 - c0) * 1000 / len(targets),
                        "detect_cpu_us_per_pod": (c2 - c1) * 1e6 / len(targets),
                        "wall_s": w2 - w0,
                        "unreachable": sum(not s.reachable for s in samples.values()),
                        "verdicts": counts,
                        "wedged_pods": sorted(k for k, v in verdicts.items() if isinstance(v, Wedged)),
                    }
                )
            # Captured responses of one pod of each kind, for the parse-only cost.
            texts = {}
            for kind, idx in (("builtin", 2), ("sglang", 3)):
                base = targets[idx].base_url
                path = "/v1/loads?include=disagg" if kind == "sglang" else "/v1/loads"
                texts[kind] = (await _fetch(client, base + "/metrics"), await _fetch(client, base + path))
        finally:
            await (client.aclose() if args.client == "httpx" else client.close())
    finally:
        server.terminate()
        server.wait(timeout=10)

    steady = rounds[1:] if len(rounds) > 1 else rounds
    expected_wedged = sorted(f"pod-{i}" for i in range(args.pods) if _pod_kind(i)[2])
    return {
        "benchmark": "watchdog_scale",
        "pods": args.pods,
        "intervals": args.intervals,
        "interval_s": args.interval_s,
        "concurrency": args.concurrency,
        "http_client": args.client,
        "detector_window_s": window,
        "pods_sglang": sum(1 for i in range(args.pods) if _pod_kind(i)[1] == "sglang"),
        "metrics_bytes_per_pod": {k: len(v[0].encode()) for k, v in texts.items()},
        "metrics_lines_per_pod": {k: v[0].count("\n") for k, v in texts.items()},
        "cpu_ms_per_pod_per_scrape": {
            "first_round": round(rounds[0]["cpu_ms_per_pod"], 4),
            "steady_median": round(statistics.median(r["cpu_ms_per_pod"] for r in steady), 4),
            "steady_max": round(max(r["cpu_ms_per_pod"] for r in steady), 4),
            "target": 1.0,
        },
        "breakdown_steady_median": {
            "scrape_cpu_ms_per_pod": round(statistics.median(r["scrape_cpu_ms_per_pod"] for r in steady), 4),
            "detect_cpu_us_per_pod": round(statistics.median(r["detect_cpu_us_per_pod"] for r in steady), 2),
            "parse_only_us_per_pod": _parse_cost_us(texts),
        },
        "wall_s_per_round": {
            "median": round(statistics.median(r["wall_s"] for r in steady), 3),
            "max": round(max(r["wall_s"] for r in steady), 3),
        },
        "rss_mb": {
            "before_scraping": round(rss_before, 1),
            "after": round(_rss_mb(), 1),
            "peak": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "with_operator_deps_imported": args.with_operator_deps,
            "target": 200,
        },
        "unreachable_total": sum(r["unreachable"] for r in rounds),
        "final_verdicts": rounds[-1]["verdicts"],
        "wedged_detected": rounds[-1]["wedged_pods"],
        "wedged_expected": expected_wedged,
        "host": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "note": "2 shared cores; CPU time is process time of the watchdog process "
            "only (the simulated fleet runs in another process)",
        },
        "rounds": rounds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=int, default=500)
    ap.add_argument("--intervals", type=int, default=8)
    ap.add_argument("--interval-s", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument(
        "--client",
        choices=("aiohttp", "httpx"),
        default="aiohttp",
        help="HTTP client of the scrape (aiohttp is what the watchdog uses)",
    )
    ap.add_argument(
        "--no-operator-deps",
        dest="with_operator_deps",
        action="store_false",
        help="do not import kopf/kubernetes_asyncio before measuring RSS",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "watchdog_scale.json")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        asyncio.run(serve(args.pods))
        return
    result = asyncio.run(measure(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    summary = {
        k: result[k]
        for k in (
            "pods",
            "cpu_ms_per_pod_per_scrape",
            "breakdown_steady_median",
            "wall_s_per_round",
            "rss_mb",
            "unreachable_total",
            "final_verdicts",
        )
    }
    summary["wedged_detected_as_expected"] = result["wedged_detected"] == result["wedged_expected"]
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
