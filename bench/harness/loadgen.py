"""HTTP load for OpenAI-compatible completion servers (ours, the PD router, vllm) and the
statistics of what came back.

Requests stream (SSE) with token-id prompts, greedy, `ignore_eos`, so every request produces
exactly `max_tokens` tokens on every server. The client is aiohttp: on a 2-core machine the
load generator shares the cores with the server, and aiohttp costs far less CPU per event than
httpx. Two workloads:
  fixed       a closed loop: `concurrency` clients, each sending its share of the prompts
              back to back (so the server sees about `concurrency` requests at all times);
  multiround  conversations running side by side, each round's prompt = the previous prompt +
              the previous answer + fresh tokens, so contexts grow every round (the shape that
              wedged production, see docs/design.md).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Optional

import aiohttp


@dataclass
class RequestResult:
    start: float
    end: float = 0.0
    first_token: Optional[float] = None
    token_times: list[float] = field(default_factory=list)  # arrival time of each output token
    output_ids: list[int] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    round: int = 0
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first_token is None else self.first_token - self.start


# ---- pure statistics ------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> Optional[float]:
    """q in [0, 100], linear interpolation between the closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def inter_token_gaps(token_times: list[float]) -> list[float]:
    return [b - a for a, b in zip(token_times, token_times[1:])]


def summarize(results: list[RequestResult], wall: float) -> dict:
    """Output tok/s over the wall time of the run, TTFT and inter-token latency percentiles (ms)."""
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in inter_token_gaps(r.token_times)]
    tokens = sum(r.completion_tokens for r in ok)

    def ms(x: Optional[float]) -> Optional[float]:
        return None if x is None else round(x * 1000.0, 3)

    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results if not r.ok), None),
        "completion_tokens": tokens,
        "wall_s": round(wall, 4),
        "output_tok_s": round(tokens / wall, 2) if wall > 0 else None,
        "ttft_p50_ms": ms(percentile(ttfts, 50)),
        "ttft_p99_ms": ms(percentile(ttfts, 99)),
        "ttft_mean_ms": ms(sum(ttfts) / len(ttfts)) if ttfts else None,
        "itl_p50_ms": ms(percentile(gaps, 50)),
        "itl_p99_ms": ms(percentile(gaps, 99)),
    }


def best_of(runs: list[dict]) -> dict:
    """The run with the highest output tok/s (a run with errors never wins over a clean one)."""
    return max(runs, key=lambda s: (s["errors"] == 0, s["output_tok_s"] or 0.0))


# ---- prompts --------------------------------------------------------------------------------------


def random_prompts(n: int, length: int, vocab_size: int, seed: int, low: int = 16) -> list[list[int]]:
    """Token ids clear of the special tokens at the bottom of our vocab; the same for every server."""
    rng = random.Random(seed)
    return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(n)]


# ---- the client -----------------------------------------------------------------------------------


def completion_body(model: Optional[str], prompt: list[int], max_tokens: int) -> dict:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if model:
        body["model"] = model
    return body


def apply_chunk(res: RequestResult, chunk: dict, now: float) -> None:
    """Fold one SSE chunk into the result: tokens (by id when the server sends them, else one per
    non-empty text delta), their arrival time, usage and errors."""
    if "error" in chunk and not chunk.get("choices"):
        err = chunk["error"]
        res.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        return
    for choice in chunk.get("choices") or []:
        ids = choice.get("token_ids")
        n = len(ids) if ids is not None else (1 if choice.get("text") else 0)
        if ids:
            res.output_ids.extend(ids)
        if n and res.first_token is None:
            res.first_token = now
        res.token_times.extend([now] * n)
    usage = chunk.get("usage")
    if usage:
        res.completion_tokens = usage.get("completion_tokens", 0)
        res.prompt_tokens = usage.get("prompt_tokens", 0)


async def stream_completion(
    session: aiohttp.ClientSession, url: str, model: Optional[str], prompt: list[int], max_tokens: int, round_: int = 0
) -> RequestResult:
    res = RequestResult(start=time.perf_counter(), round=round_)
    try:
        async with session.post(f"{url}/v1/completions", json=completion_body(model, prompt, max_tokens)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                apply_chunk(res, json.loads(data), time.perf_counter())
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.end = time.perf_counter()
    if res.ok and res.completion_tokens == 0:
        res.completion_tokens = len(res.token_times)  # a server that sent no usage
    if res.ok and res.completion_tokens != max_tokens:
        res.error = f"expected {max_tokens} tokens, got {res.completion_tokens}"
    return res


def _session(timeout: float) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout), connector=aiohttp.TCPConnector(limit=0, force_close=False)
    )


async def run_fixed(
    url: str, model: Optional[str], prompts: list[list[int]], concurrency: int, max_tokens: int, timeout: float = 600.0
) -> tuple[list[RequestResult], float]:
    """Closed loop: `concurrency` clients drain the prompt list; returns results and wall time."""
    todo = list(enumerate(prompts))
    results: list[RequestResult] = []
    async with _session(timeout) as session:

        async def client() -> None:
            while todo:
                _, prompt = todo.pop(0)
                results.append(await stream_completion(session, url, model, prompt, max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return results, time.perf_counter() - t0


async def run_multiround(
    url: str,
    model: Optional[str],
    first_prompts: list[list[int]],
    rounds: int,
    append: list[list[list[int]]],
    max_tokens: int,
    timeout: float = 600.0,
) -> tuple[list[RequestResult], float]:
    """One task per conversation, rounds in sequence; append[c][r] are the fresh prompt tokens
    conversation c adds before round r+1. A server that does not return token ids gets the
    answer's length in fresh tokens instead (the context grows the same)."""
    results: list[RequestResult] = []
    async with _session(timeout) as session:

        async def conversation(c: int) -> None:
            context = list(first_prompts[c])
            for r in range(rounds):
                res = await stream_completion(session, url, model, context, max_tokens, round_=r)
                results.append(res)
                if not res.ok:
                    return
                answer = (
                    res.output_ids
                    if len(res.output_ids) == res.completion_tokens
                    else append[c][r][:1] * res.completion_tokens
                )
                context = context + answer + (append[c][r] if r + 1 < rounds else [])

        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(c) for c in range(len(first_prompts))))
        return results, time.perf_counter() - t0


def multiround_inputs(
    conversations: int, prompt_len: int, rounds: int, append_len: int, vocab_size: int, seed: int
) -> tuple[list[list[int]], list[list[list[int]]]]:
    first = random_prompts(conversations, prompt_len, vocab_size, seed)
    append = [random_prompts(rounds, append_len, vocab_size, seed * 1000 + c + 1) for c in range(conversations)]
    return first, append


def multiround_context_lens(prompt_len: int, rounds: int, append_len: int, new_tokens: int) -> list[int]:
    """Prompt length of each round (the context the server must hold grows by answer + append)."""
    return [prompt_len + r * (new_tokens + append_len) for r in range(rounds)]


def per_round(results: list[RequestResult]) -> list[dict]:
    """TTFT p50 per round: shows what a growing context costs."""
    out = []
    for r in sorted({x.round for x in results}):
        rs = [x for x in results if x.round == r and x.ok]
        t = [x.ttft for x in rs if x.ttft is not None]
        out.append(
            {
                "round": r,
                "requests": len(rs),
                "prompt_tokens_p50": percentile([x.prompt_tokens for x in rs], 50),
                "ttft_p50_ms": None if not t else round(percentile(t, 50) * 1000, 3),
            }
        )
    return out
