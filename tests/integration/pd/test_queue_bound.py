"""`--max-queued-requests N` (SGLang's flag), the incident's second suspect (issue 45): a burst
past the engines' queue bound gets 429s with Retry-After through the router, the rest are
answered whole, and nothing is left half-registered in any PD queue on either side afterwards
(the PD state gauges all back at 0, every page free).

Real processes on 127.0.0.1 (tiny model): a prefill and a decode engine, each with
`--max-num-seqs 2 --max-queued-requests 2`, and the router; the official `openai` client."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from bench.harness.migration_chaos import Cluster, wait_idle

BURST = 32
PD_GAUGES = (
    "dsv4:num_queue_reqs",
    "dsv4:num_running_reqs",
    "dsv4:num_prefill_bootstrap_queue_reqs",
    "dsv4:num_prefill_inflight_queue_reqs",
    "dsv4:num_decode_prealloc_queue_reqs",
    "dsv4:num_decode_transfer_queue_reqs",
)


async def _burst(url: str, n: int = BURST) -> tuple[int, list[str], list[str]]:
    """(answered whole, Retry-After of each 429, any other failure)."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    ok, retry_after, other = 0, [], []

    async def one(i: int) -> None:
        nonlocal ok
        try:
            stream = await client.completions.create(
                model="m",
                prompt=[(5 * i + j) % 300 + 3 for j in range(6 + i % 5)],
                max_tokens=16,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            usage = None
            async for chunk in stream:
                usage = chunk.usage or usage
            if usage is None or usage.completion_tokens != 16:
                other.append(f"{i}: usage {usage}")
            else:
                ok += 1
        except openai.RateLimitError as e:
            retry_after.append(e.response.headers.get("retry-after", ""))
            if "queue is full" not in str(e):
                other.append(f"{i}: 429 without the reason: {e}")
        except Exception as e:  # any other error the client sees fails the test
            other.append(f"{i}: {type(e).__name__}: {e}")

    try:
        await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await client.close()
    return ok, retry_after, other


@pytest.mark.slow  # ~12 s; the default run has the fault matrix's queue_burst cell (test_fault_matrix.py)
def test_a_burst_past_the_queue_bound_gets_429s_and_leaves_no_pd_state(tiny_model, tmp_path):
    c = Cluster(tiny_model, tmp_path, decodes=1, engine_args=["--max-num-seqs", 2, "--max-queued-requests", 2])
    try:
        ok, retry_after, other = asyncio.run(_burst(c.r_url))
        assert not other, other[:5]
        assert retry_after, "the burst never passed the bound"
        assert all(r.isdigit() and int(r) >= 1 for r in retry_after), retry_after
        assert ok >= 1, "the requests within the bound are answered"
        engines = [c.urls["prefill"], c.urls["decode0"]]
        wait_idle(engines)
        refused = 0.0
        for url in engines:
            text = httpx.get(url + "/metrics", timeout=5).text
            for name in PD_GAUGES:
                assert _value(text, name) == 0, (url, name)
            refused += _value(text, "dsv4:num_queue_full_reqs_total")
        assert refused >= len(retry_after), refused
        # after the burst the engines serve again
        ok, retry_after, other = asyncio.run(_burst(c.r_url, 2))
        assert ok == 2 and not other and not retry_after
    finally:
        c.stop()


def _value(text: str, name: str) -> float:
    """The sum of a metric's samples in a Prometheus text page."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))
