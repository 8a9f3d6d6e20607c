"""Routing by what each engine holds, simulated: prefix reuse and load of placement rules on an
agent trace, against N simulated engines with LRU page caches.

The trace (bench.harness.agent_trace) follows the shapes published agent traces show; see there.

Each simulated engine has an LRU page cache that evicts leaves first (a request touches its
chain's pages tail first, so a prefix is always more recent than what follows it, as in a radix
cache), a FIFO prefill server at `prefill_tps` tokens/s over uncached tokens and decoding at
`tpot_s` per token beside it. Its load, as the rule sees it: queued prefill tokens plus the
context tokens of requests decoding. Engines publish stored/evicted events into the router's
real `CacheIndex` (dsv4_router.cache_index), applied `event_lag_s` later.

Rules: round robin; today's affinity (the router's own `ConversationKeys` + `choose`: a
rendezvous hash of the first two messages within an in-flight bound); least load; the cache
rule (dsv4_router.scoring.choose over the index); and an oracle with one shared cache the
size of the whole fleet's pool (placement irrelevant).

    python -m bench.suites.route_sim [--engines 8] [--ids-share 0.5] [--seed 1] [--out bench/results/route_sim]

Reports prefix reuse (cached prompt tokens / prompt tokens, after a warm-up), max/mean of each
engine's time-averaged load, TTFT under the queue model, and writes JSON + PNG.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import platform
import time
from collections import OrderedDict, deque
from dataclasses import asdict
from pathlib import Path


import numpy as np

from bench import RESULTS
from bench.harness.agent_trace import Request, TraceParams, make_trace
from dsv4_router.affinity import ConversationKeys, choose as affinity_choose
from dsv4_router.cache_events import CacheEvents, CacheSnapshot, Change
from dsv4_router.cache_index import CacheIndex
from dsv4_router.scoring import LOAD_WEIGHT, Candidate, TierCosts, choose as cache_choose


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# ---- engines ----------------------------------------------------------------------------------------


class Engine:
    """An LRU page cache (leaves first) + a FIFO prefill server + decoding beside it."""

    def __init__(self, name: str, capacity: int, prefill_tps: float, tpot_s: float, publish=None):
        self.name, self.capacity, self.prefill_tps, self.tpot_s = name, capacity, prefill_tps, tpot_s
        self.lru: OrderedDict = OrderedDict()
        self.publish = publish  # (kind, hashes) -> None
        self.busy_until = 0.0
        self.waiting: list = []  # heap (decode start, decode end, context tokens)
        self.decoding: list = []  # heap (decode end, context tokens)
        self.running_tokens = 0
        self.inflight: list = []  # heap of request end times (today's affinity counts these)
        self.load_area = 0.0
        self.last_t = 0.0
        self.requests = 0
        self.prefill_busy = 0.0

    def held(self, chain: list, n: int) -> int:
        lru, i = self.lru, 0
        while i < n and chain[i] in lru:
            i += 1
        return i

    def touch(self, chain: list, n: int) -> None:
        lru, stored = self.lru, []
        for h in reversed(chain[:n]):  # the head last: a prefix is always more recent than its tail
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                stored.append(h)
        evicted = []
        while len(lru) > self.capacity:
            evicted.append(lru.popitem(last=False)[0])
        if self.publish is not None:
            if stored:
                self.publish("stored", stored)
            if evicted:
                self.publish("evicted", evicted)

    def advance(self, t: float) -> None:
        """Move the engine's clock to t (loads accrue)."""
        while True:
            nxt = min(
                self.waiting[0][0] if self.waiting else math.inf, self.decoding[0][0] if self.decoding else math.inf
            )
            if nxt > t:
                break
            self._accrue(nxt)
            if self.waiting and self.waiting[0][0] == nxt:
                _, end, ctx = heapq.heappop(self.waiting)
                heapq.heappush(self.decoding, (end, ctx))
                self.running_tokens += ctx
            else:
                _, ctx = heapq.heappop(self.decoding)
                self.running_tokens -= ctx
        self._accrue(t)
        while self.inflight and self.inflight[0] <= t:
            heapq.heappop(self.inflight)

    def _accrue(self, t: float) -> None:
        a = self.last_t
        if t <= a:
            return
        # the decoding part is constant on [a, t]; the prefill queue drains linearly until busy_until
        b = min(t, max(a, self.busy_until))
        q0, q1 = (self.busy_until - a) * self.prefill_tps, (self.busy_until - b) * self.prefill_tps
        self.load_area += self.running_tokens * (t - a) + (q0 + q1) / 2 * (b - a)
        self.last_t = t

    def load(self, t: float) -> float:
        """Queued prefill tokens + context tokens decoding."""
        return max(0.0, self.busy_until - t) * self.prefill_tps + self.running_tokens

    def admit(self, t: float, req: Request, hit_pages: int) -> float:
        """The request starts here; returns its TTFT."""
        hit = min(hit_pages * PAGE[0], req.prompt_len - 1)
        uncached = req.prompt_len - hit
        start = max(t, self.busy_until)
        work = uncached / self.prefill_tps
        self.busy_until = start + work
        self.prefill_busy += work
        end = self.busy_until + req.output_len * self.tpot_s
        heapq.heappush(self.waiting, (self.busy_until, end, req.prompt_len + req.output_len))
        heapq.heappush(self.inflight, end)
        self.requests += 1
        return self.busy_until - t


PAGE = [64]


# ---- rules ------------------------------------------------------------------------------------------


def run_rule(rule: str, reqs: list[Request], p: TraceParams, engines_n: int, pool_pages: int, args) -> dict:
    index = CacheIndex(stale_after=math.inf)
    pending_events: deque = deque()

    def publisher(name: str):
        seqs = [0]

        def publish(kind: str, hashes: list) -> None:
            seqs[0] += 1
            pending_events.append(
                (now[0] + args.event_lag, name, CacheEvents("i0", seqs[0], (Change(kind, "device", tuple(hashes)),)))
            )

        return publish

    now = [0.0]
    if rule == "oracle":
        engines = [Engine("shared", pool_pages * engines_n, args.prefill_tps * engines_n, p.tpot_s)]
    else:
        engines = [
            Engine(
                f"e{i}",
                pool_pages,
                args.prefill_tps,
                p.tpot_s,
                publisher(f"e{i}") if rule.startswith("cache") else None,
            )
            for i in range(engines_n)
        ]
    for e in engines:
        index.snapshot(e.name, CacheSnapshot("i0", 0, {}, p.page, p.page), 0.0)
    by_name = {e.name: e for e in engines}
    keys = ConversationKeys()
    last: dict[int, str] = {}
    rr = [0]
    hits = prompts = 0
    ttfts: list[float] = []
    costs = TierCosts()
    load_weight = float(rule.split("@")[1]) if "@" in rule else args.load_weight
    t0 = time.perf_counter()
    for req in reqs:
        now[0] = req.t
        for e in engines:
            e.advance(req.t)
        while pending_events and pending_events[0][0] <= req.t:
            _, name, ev = pending_events.popleft()
            index.event(name, ev, req.t)
        if rule == "oracle":
            e = engines[0]
        elif rule == "round_robin":
            e = engines[rr[0] % engines_n]
            rr[0] += 1
        elif rule == "least_load":
            e = min(engines, key=lambda x: (x.load(req.t), x.name))
        elif rule == "affinity":
            if req.head is not None:  # through /v1/completions with token ids: keyed by the first ids
                key = keys.key(COMPLETIONS, {"prompt": req.head})
            else:
                body = {
                    "messages": [
                        {"role": "system", "content": f"agent type {req.system}"},
                        {"role": "user", "content": f"task {req.first}"},
                    ]
                }
                key = keys.key(CHAT, body)
            e = by_name[affinity_choose(key, {x.name: len(x.inflight) for x in engines})]
        else:  # the cache rule
            chain = req.chain[: req.prompt_pages]
            match = index.match(chain, [x.name for x in engines], req.t)
            cands = [Candidate(x.name, x.load(req.t), match[x.name]) for x in engines]
            name = cache_choose(
                req.prompt_len,
                p.page,
                cands,
                key=str(req.session),
                last=last.get(req.session),
                costs=costs,
                load_weight=load_weight,
            )
            e = by_name[name]
            last[req.session] = name
        held = e.held(req.chain, req.prompt_pages)
        e.touch(req.chain, req.store_pages)
        ttft = e.admit(req.t, req, held)
        if req.t >= p.warmup_s:
            hits += min(held * p.page, req.prompt_len - 1)
            prompts += req.prompt_len
            ttfts.append(ttft)
    end = reqs[-1].t
    for e in engines:
        e.advance(end)
    span = end - p.warmup_s
    # time-averaged load over the whole run (warm-up included: the queue model starts empty)
    loads = [e.load_area / end for e in engines]
    out = {
        "rule": rule,
        "reuse": hits / prompts if prompts else 0.0,
        "prefill_tokens": prompts - hits,
        "ttft_p50_s": float(np.percentile(ttfts, 50)),
        "ttft_p90_s": float(np.percentile(ttfts, 90)),
        "ttft_p99_s": float(np.percentile(ttfts, 99)),
        "sim_s": round(time.perf_counter() - t0, 1),
        "measured_span_s": span,
    }
    if rule != "oracle":
        out["load_max_over_mean"] = max(loads) / (sum(loads) / len(loads))
        out["loads_mean_tokens"] = [round(x) for x in loads]
        reqs_n = [e.requests for e in engines]
        out["requests_max_over_mean"] = max(reqs_n) / (sum(reqs_n) / len(reqs_n))
        busy = [e.prefill_busy / end for e in engines]
        out["prefill_busy_max"] = max(busy)
        out["prefill_busy_mean"] = sum(busy) / len(busy)
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rules"] if "@" not in r["rule"]]
    names = [r["rule"] for r in rows]
    oracle = next((r["reuse"] for r in result["rules"] if r["rule"] == "oracle"), None)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    ax = axes[0]
    ax.bar(names, [r["reuse"] for r in rows], color=["#c33" if n == "cache" else "#888" for n in names])
    for i, r in enumerate(rows):
        ax.text(i, r["reuse"], f"{r['reuse']:.3f}", ha="center", va="bottom", fontsize=8)
    ax.set_title("prefix reuse (cached / prompt tokens)")
    ax.tick_params(axis="x", rotation=20)
    ax = axes[1]
    lr = [r for r in rows if "load_max_over_mean" in r]
    ax.bar([r["rule"] for r in lr], [r["load_max_over_mean"] for r in lr], color="#468")
    ax.axhline(1.3, color="k", ls="--", lw=1, label="target 1.3")
    ax.set_ylim(0.9, max(1.5, max(r["load_max_over_mean"] for r in lr) + 0.1))
    ax.legend()
    ax.set_title("max / mean engine load (running + queued tokens, time-averaged)")
    ax.tick_params(axis="x", rotation=20)
    ax = axes[2]
    sweep = sorted(
        (
            (float(r["rule"].split("@")[1]) if "@" in r["rule"] else result["load_weight"], r)
            for r in result["rules"]
            if r["rule"].startswith("cache")
        ),
        key=lambda x: x[0],
    )
    if sweep and oracle:
        xs = [w for w, _ in sweep]
        ax.plot(xs, [r["reuse"] / oracle for _, r in sweep], "o-", label="reuse / oracle's")
        ax.plot(xs, [r["load_max_over_mean"] for _, r in sweep], "s-", label="load max/mean")
        ax.axvline(result["load_weight"], color="#c33", lw=1, ls=":", label="default weight")
        ax.set_xscale("log")
        ax.set_xlabel("load weight (tokens recomputed per token of load)")
        ax.legend()
        ax.set_title("the cache rule across load weights")
    tp = result["trace"]
    fig.suptitle(
        f"{result['engines']} engines, {tp['requests']} requests ({result['mix']}), "
        f"working set {result['ws_over_pool']:.1f}x the fleet's pool"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--duration", type=float, default=2400.0)
    ap.add_argument("--warmup", type=float, default=1200.0)
    ap.add_argument(
        "--session-rate", type=float, default=None, help="new sessions per second (default: scales with --engines)"
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ws-over-pool", type=float, default=3.0, help="the working set over the fleet's pool (2-4 asked)")
    ap.add_argument("--prefill-tps", type=float, default=40000.0, help="each engine's prefill rate (tokens/s)")
    ap.add_argument("--event-lag", type=float, default=0.02, help="seconds from an engine's cache change to the index")
    ap.add_argument("--load-weight", type=float, default=LOAD_WEIGHT, help="the cache rule's (cache@W: another)")
    ap.add_argument("--team-p", type=float, default=None, help="share of arrivals that are broadcast teams")
    ap.add_argument("--ids-share", type=float, default=0.0, help="share of sessions sent as token ids (completions)")
    ap.add_argument("--team-k", default=None, help="team sizes, LO,HI")
    ap.add_argument("--rules", default="round_robin,affinity,least_load,cache,oracle,cache@0.01,cache@0.1,cache@1")
    ap.add_argument("--out", default=str(RESULTS / "route_sim"))
    args = ap.parse_args()
    p = TraceParams(duration_s=args.duration, warmup_s=args.warmup)
    p.session_rate = args.session_rate if args.session_rate is not None else 0.08 * args.engines
    PAGE[0] = p.page
    p.ids_share = args.ids_share
    if args.team_p is not None:
        p.team_p = args.team_p
    if args.team_k is not None:
        p.team_k = tuple(int(x) for x in args.team_k.split(","))
    t0 = time.perf_counter()
    reqs, stats = make_trace(p, args.seed)
    stats["gen_s"] = round(time.perf_counter() - t0, 1)
    pool = int(stats["working_set_pages_mean"] / args.ws_over_pool / args.engines)
    print(f"trace: {json.dumps(stats)}; pool {pool} pages per engine", flush=True)
    rows = []
    for rule in args.rules.split(","):
        r = run_rule(rule, reqs, p, args.engines, pool, args)
        rows.append(r)
        print(json.dumps(r), flush=True)
    oracle = next((r for r in rows if r["rule"] == "oracle"), None)
    aff = next((r for r in rows if r["rule"] == "affinity"), None)
    cache = next((r for r in rows if r["rule"] == "cache"), None)
    result = {
        "what": "prefix reuse and load of placement rules on a simulated agent trace (bench/suites/route_sim.py)",
        "engines": args.engines,
        "mix": "chat" if not p.ids_share else f"ids{round(p.ids_share * 100)}",
        "seed": args.seed,
        "pool_pages_per_engine": pool,
        "ws_over_pool": stats["working_set_pages_mean"] / (pool * args.engines),
        "prefill_tps": args.prefill_tps,
        "event_lag_s": args.event_lag,
        "load_weight": args.load_weight,
        "trace_params": asdict(p),
        "trace": stats,
        "rules": rows,
        "machine": {"python": platform.python_version()},
    }
    if cache and oracle and aff:
        result["targets"] = {
            "reuse_over_oracle": cache["reuse"] / oracle["reuse"],
            "reuse_over_affinity": cache["reuse"] / aff["reuse"],
            "load_max_over_mean": cache["load_max_over_mean"],
            "met": cache["reuse"] >= 0.95 * oracle["reuse"]
            and cache["reuse"] >= 1.2 * aff["reuse"]
            and cache["load_max_over_mean"] <= 1.3,
        }
        print(json.dumps(result["targets"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"engines{args.engines}_{result['mix']}_seed{args.seed}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / f"{stem}.png")
    print(f"wrote {out / stem}.json/.png")


if __name__ == "__main__":
    main()
