"""An agent trace of my own making for routing studies (bench/suites/route_sim.py drives it).

The trace generator (`make_trace`) follows the shapes published agent traces show. Its shape
parameters (below, all in the JSON) were fixed before any rule was run; the load level (session
arrival rate, the engines' prefill rate) and the run's length were set afterwards so the fleet
runs in a steady state at moderate utilisation (the first runs overloaded every rule alike):
- sessions whose prompt grows every round by the model's answer (reasoning + a tool call) and
  tool results, re-sending the whole conversation (the Mooncake tool-agent and Claude Code /
  Codex traces: prompts grow monotonically across turns, most input tokens are a prefix seen
  before);
- a handful of agent types sharing long system prompts (tool schemas), their popularity skewed;
  single requests sharing a system prompt are most of the reuse in API traffic (Aliyun's
  "KVCache in the wild" study);
- tool-result bursts (parallel tool calls: several results appended at once, heavy-tailed sizes:
  a file read is thousands of tokens);
- sub-agents: a round spawns 1-4 sub-agents with their own system prompt and a task of their
  own; the parent waits for them and gets their reports as tool results;
- teams: a few sessions start as a broadcast (K agents with the same system prompt and first
  message, diverging from their first answer on);
- context compaction: a conversation past `max_context` restarts from its system prompt and a
  summary (as the Claude Code traces show);
- skewed popularity: each session has a rank, its think/tool time grows with it, so request
  share per session follows a Zipf law (hot agents loop on tools within seconds, cold ones
  come back after minutes: reuse distances span both, as in the Aliyun study);
- sessions arrive (Poisson) and leave (after their rounds), so the working set moves; the
  fleet's pool is sized at 1/`ws_over_pool` of the time-averaged working set (2-4x asked);
- the API mix: `ids_share` of the sessions are sent through /v1/completions as token ids (a
  client-side template, as token-in/token-out harnesses and RL rollouts do), the rest as chat;
  today's affinity keys the former by their first 128 ids, the latter by the first two messages.

The trace is open loop (request times are fixed by nominal service times, the same for every
rule), so every rule sees the very same requests.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from dataclasses import dataclass

import numpy as np

from dsv4_wire import kv_events

ROOT_HASH = kv_events.root_hash()


def _chain(packed: bytes, page: int, parent: bytes) -> list[bytes]:
    """The contract's page hashes (dsv4_wire.kv_events) of tokens packed as little-endian uint32,
    continuing a chain at `parent`: the same bytes kv_events.chain_hash hashes, without
    unpacking numpy's tokens into lists (checked against it at start-up)."""
    out, step = [], 4 * page
    for start in range(0, len(packed) - step + 1, step):
        parent = hashlib.blake2b(parent + packed[start : start + step], digest_size=16).digest()
        out.append(parent)
    return out


_probe = np.arange(7, 7 + 130, dtype="<u4")
assert _chain(_probe.tobytes(), 64, ROOT_HASH) == kv_events.page_hashes(_probe.tolist(), 64)


@dataclass
class TraceParams:
    duration_s: float = 2400.0
    warmup_s: float = 1200.0  # reuse and load are counted after this (sessions live ~10 min)
    page: int = 64
    session_rate: float = 1.2  # new sessions (or teams) per second
    agent_types: int = 8
    type_zipf: float = 1.0
    system_tokens: tuple = (1500, 8000)  # uniform range per agent type
    first_median: float = 400.0
    first_sigma: float = 1.0
    answer_median: float = 250.0  # reasoning + tool call per round
    answer_sigma: float = 0.8
    tool_median: float = 600.0
    tool_sigma: float = 1.2
    tool_max: int = 16000
    burst_p: float = 0.25  # a round with parallel tool calls
    burst_k: tuple = (2, 6)
    rounds_median: float = 12.0
    rounds_sigma: float = 0.9
    rounds_max: int = 150
    rank_max: int = 64  # popularity ranks 1..rank_max; think time grows with the rank
    think_base_s: float = 1.5
    subagent_p: float = 0.05  # per round
    subagent_k: tuple = (1, 4)
    subagent_types: int = 3
    subagent_rounds_median: float = 5.0
    report_tokens: tuple = (200, 1500)
    team_p: float = 0.1  # a new arrival is a broadcast team
    team_k: tuple = (3, 8)
    ids_share: float = 0.0  # sessions sent through /v1/completions as token ids (client-side template)
    max_context: int = 96000
    summary_tokens: tuple = (1000, 4000)
    nominal_prefill_tps: float = 20000.0  # only to space a session's rounds
    tpot_s: float = 0.02


@dataclass
class Request:
    t: float
    session: int
    prompt_len: int
    output_len: int
    chain: list  # the session's page chain (shared, append-only); this request uses a prefix
    prompt_pages: int  # full pages of the prompt
    store_pages: int  # full pages of prompt + answer (what the engine holds after it)
    system: int  # agent type (for today's affinity key)
    first: int  # id of the first user message (idem)
    head: object = None  # a token-id session's first ids (what today's affinity keys it by), else None


class _Tokens:
    """Unique token content from a counter; shared content made once and reused."""

    def __init__(self) -> None:
        self.next = 1000

    def fresh(self, n: int) -> np.ndarray:
        out = np.arange(self.next, self.next + n, dtype="<u4")
        self.next += n
        return out


class _Session:
    __slots__ = ("sid", "system", "first", "chain", "tail", "ntok", "sys_tokens", "rank", "rounds_left", "sub", "ids")

    def __init__(self, sid: int, system: int, sys_tokens: np.ndarray, first: int, rank: int, rounds: int, sub: bool):
        self.sid, self.system, self.first, self.rank, self.rounds_left, self.sub = sid, system, first, rank, rounds, sub
        self.sys_tokens = sys_tokens
        self.chain: list = []
        self.tail = b""
        self.ntok = 0
        self.ids = False

    def extend(self, tokens: np.ndarray, page: int, live: dict) -> None:
        raw = self.tail + tokens.tobytes()
        full = len(raw) // (4 * page) * 4 * page
        parent = self.chain[-1] if self.chain else b""
        new = _chain(raw[:full], page, parent or ROOT_HASH)
        self.chain.extend(new)
        for h in new:
            live[h] = live.get(h, 0) + 1
        self.tail = raw[full:]
        self.ntok += len(tokens)

    def release(self, live: dict) -> None:
        for h in self.chain:
            n = live[h] - 1
            if n:
                live[h] = n
            else:
                del live[h]


def _lognorm(rng, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, rng.lognormal(math.log(median), sigma))))


def make_trace(p: TraceParams, seed: int) -> tuple[list[Request], dict]:
    rng = np.random.default_rng(seed)
    toks = _Tokens()
    sys_prompts = [toks.fresh(int(rng.integers(*p.system_tokens))) for _ in range(p.agent_types)]
    sub_prompts = [toks.fresh(int(rng.integers(*p.system_tokens))) for _ in range(p.subagent_types)]
    type_w = 1.0 / np.arange(1, p.agent_types + 1) ** p.type_zipf
    type_w /= type_w.sum()
    live: dict = {}  # page hash -> live sessions holding it (the working set)
    heap: list = []  # (time, seq, action, payload)
    seq = [0]
    sessions: dict[int, _Session] = {}
    waiting: dict[int, list] = {}  # parent sid -> [children left, report tokens so far]
    requests: list[Request] = []
    ws_samples: list[tuple[float, int]] = []
    firsts = [0]
    sids = [0]
    last_len: dict[int, int] = {}  # sid -> tokens of its conversation the previous round ended with
    sub_parent: dict[int, int] = {}  # a sub-agent's sid -> its parent's

    def push(t: float, action: str, payload) -> None:
        seq[0] += 1
        heapq.heappush(heap, (t, seq[0], action, payload))

    def new_session(
        t: float, system: int, sys_tokens, first_tokens, first_id: int, sub: bool, rounds: int, ids: bool
    ) -> int:
        sid = sids[0]
        sids[0] += 1
        rank = int(rng.integers(1, p.rank_max + 1))
        s = _Session(sid, system, sys_tokens, first_id, rank, rounds, sub)
        s.ids = ids
        sessions[sid] = s
        s.extend(np.concatenate([sys_tokens, first_tokens]), p.page, live)
        push(t, "round", sid)
        return sid

    t = 0.0
    while t < p.duration_s:
        t += rng.exponential(1.0 / p.session_rate)
        push(t, "arrive", None)

    def first_message() -> tuple[np.ndarray, int]:
        firsts[0] += 1
        return toks.fresh(_lognorm(rng, p.first_median, p.first_sigma, 20, 8000)), firsts[0]

    def rounds_of(median: float) -> int:
        return _lognorm(rng, median, p.rounds_sigma, 1, p.rounds_max)

    next_sample = 0.0
    while heap:
        t, _, action, payload = heapq.heappop(heap)
        if t > p.duration_s:
            break
        while next_sample <= t:
            ws_samples.append((next_sample, len(live)))
            next_sample += 10.0
        if action == "arrive":
            system = int(rng.choice(p.agent_types, p=type_w))
            first, fid = first_message()
            k = int(rng.integers(p.team_k[0], p.team_k[1] + 1)) if rng.random() < p.team_p else 1
            ids = bool(rng.random() < p.ids_share)
            for _ in range(k):  # a team: the same system prompt and first message
                new_session(t, system, sys_prompts[system], first, fid, False, rounds_of(p.rounds_median), ids)
            continue
        s = sessions[payload]
        if action == "resume":  # a parent's sub-agents reported: their reports are tool results
            reports = waiting.pop(s.sid)[1]
            s.extend(toks.fresh(reports), p.page, live)
            push(t, "round", s.sid)
            continue
        # one round: the request (the whole conversation so far), then the answer is appended
        prompt_len = s.ntok
        answer = _lognorm(rng, p.answer_median, p.answer_sigma, 8, 4000)
        prompt_pages = len(s.chain)
        new_tokens = prompt_len - last_len.get(s.sid, 0)
        s.extend(toks.fresh(answer), p.page, live)
        head = s.sys_tokens[:128].tolist() if s.ids else None
        requests.append(
            Request(t, s.sid, prompt_len, answer, s.chain, prompt_pages, len(s.chain), s.system, s.first, head)
        )
        last_len[s.sid] = s.ntok
        service = new_tokens / p.nominal_prefill_tps + answer * p.tpot_s
        s.rounds_left -= 1
        if s.rounds_left <= 0:
            s.release(live)
            if s.sub:  # report to the parent
                parent = sub_parent.pop(s.sid)
                w = waiting[parent]
                w[0] -= 1
                w[1] += int(rng.integers(*p.report_tokens))
                if w[0] == 0:
                    push(t + service, "resume", parent)
            del sessions[s.sid]
            continue
        think = rng.exponential(p.think_base_s * s.rank**1.0)
        if not s.sub and rng.random() < p.subagent_p:  # spawn sub-agents; wait for their reports
            k = int(rng.integers(p.subagent_k[0], p.subagent_k[1] + 1))
            waiting[s.sid] = [k, 0]
            for _ in range(k):
                st = int(rng.integers(p.subagent_types))
                task, fid = first_message()
                kid = new_session(
                    t + service, 1000 + st, sub_prompts[st], task, fid, True, rounds_of(p.subagent_rounds_median), s.ids
                )
                sub_parent[kid] = s.sid
            continue
        n = int(rng.integers(p.burst_k[0], p.burst_k[1] + 1)) if rng.random() < p.burst_p else 1
        tool = sum(_lognorm(rng, p.tool_median, p.tool_sigma, 10, p.tool_max) for _ in range(n))
        if s.ntok + tool > p.max_context:  # compaction: restart from the system prompt + a summary
            s.release(live)
            s.chain, s.tail, s.ntok = [], b"", 0
            summary = toks.fresh(int(rng.integers(*p.summary_tokens)))
            firsts[0] += 1
            s.first = firsts[0]
            s.extend(np.concatenate([s.sys_tokens, summary]), p.page, live)
            last_len[s.sid] = 0
        else:
            s.extend(toks.fresh(tool), p.page, live)
        push(t + service + think, "round", s.sid)
    ws = [n for tt, n in ws_samples if tt >= p.warmup_s]
    stats = {
        "requests": len(requests),
        "sessions": sids[0],
        "working_set_pages_mean": float(np.mean(ws)) if ws else 0.0,
        "working_set_pages_max": int(max(ws)) if ws else 0,
        "prompt_tokens_mean": float(np.mean([r.prompt_len for r in requests])) if requests else 0.0,
        "prompt_tokens_p99": float(np.percentile([r.prompt_len for r in requests], 99)) if requests else 0.0,
        "requests_per_s": len(requests) / p.duration_s,
    }
    return requests, stats
