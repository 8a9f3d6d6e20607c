"""A real `dsv4 serve` with a pool barely larger than one request, hit the way a reviewer would:
identical prompts all in flight at once, prompts that are prefixes of each other (page
multiples and one off), a fully cached prompt, seeded sampling, chat with content parts, and
streaming clients that hang up. Every completed answer equals a --disable-prefix-cache
server's, and once idle no page is referenced: every cached page is idle and counted free."""

from __future__ import annotations

import asyncio
import random
import re
import time

import httpx

from bench.harness.commands import serving_all
from dsv4_wire import EngineFlags
from dsv4_wire.metrics import metric_name

rng = random.Random(3)
BASE = [rng.randrange(3, 400) for _ in range(70)]
LENGTHS = [1, 2, 15, 16, 17, 31, 32, 33, 48, 64, 65]  # around page boundaries (16)


async def complete(c: httpx.AsyncClient, prompt: list[int], n: int, **extra):
    r = await c.post(
        "/v1/completions",
        json={
            "model": "m",
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            **extra,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


async def hang_up(c: httpx.AsyncClient, prompt: list[int], after: int) -> None:
    """A streaming client that goes away after `after` events."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        seen = 0
        async for line in r.aiter_lines():
            seen += line.startswith("data:")
            if seen >= after:
                return


async def workload(url: str) -> dict:
    out: dict = {}
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        out["identical"] = await asyncio.gather(*[complete(c, BASE[:40], 8) for _ in range(10)])
        out["family_at_once"] = await asyncio.gather(*[complete(c, BASE[:k], 5) for k in LENGTHS])
        out["family_in_turn"] = [await complete(c, BASE[:k], 5) for k in LENGTHS]
        out["fully_cached"] = [await complete(c, BASE[:64], 5) for _ in range(2)]
        mixed = []
        for i in range(12):
            p = BASE[: 10 + 5 * i]
            mixed.append(hang_up(c, p, 1 + i % 3) if i % 3 == 0 else complete(c, p, 6))
        out["mixed"] = [x for x in await asyncio.gather(*mixed) if x is not None]
        out["seeded"] = [await complete(c, BASE[:50], 8, temperature=0.9, seed=5) for _ in range(2)]
        chat = []
        for _ in range(2):
            r = await c.post(
                "/v1/chat/completions",
                json={
                    "model": "m",
                    "max_tokens": 5,
                    "temperature": 0,
                    "messages": [
                        {"role": "system", "content": [{"type": "text", "text": "You are terse. " * 6}]},
                        {
                            "role": "user",
                            "content": [{"type": "text", "text": "Plan a walk. "}, {"type": "text", "text": "Short."}],
                        },
                    ],
                },
            )
            assert r.status_code == 200, r.text
            chat.append(r.json()["choices"][0]["message"]["content"])
        out["chat"] = chat
        deadline = time.monotonic() + 30
        while True:  # the hung-up streams' aborts land
            loads = (await c.get("/v1/loads")).json()
            if not loads["queues"]["running"] and not loads["queues"]["waiting"]:
                break
            assert time.monotonic() < deadline, loads
            await asyncio.sleep(0.05)
        out["loads"] = loads
        out["metrics"] = (await c.get("/metrics")).text
    return out


def test_tiny_pool_shared_prefixes_and_hang_ups_match_a_server_without_the_cache(tiny_model, tmp_path):
    common = [
        "--model",
        tiny_model,
        "--kv-pages",
        6,
        "--page-size",
        16,
        "--max-num-seqs",
        4,
        "--served-model-name",
        "m",
    ]
    with serving_all(
        [(common, tmp_path / "on.log"), ([*common, EngineFlags.DISABLE_PREFIX_CACHE], tmp_path / "off.log")]
    ) as (
        on_url,
        off_url,
    ):
        on = asyncio.run(workload(on_url))
        off = asyncio.run(workload(off_url))
    for name in ("identical", "family_at_once", "family_in_turn", "fully_cached", "mixed", "seeded", "chat"):
        assert on[name] == off[name], name
    assert len({tuple(x) for x in on["identical"]}) == 1
    loads = on["loads"]
    assert loads["kv_pages_free"] == loads["kv_pages_total"] == 6, loads  # nothing referenced
    assert 0 < loads["kv_pages_cached"] == loads["kv_pages_cached_idle"], loads
    stats = loads["prefix_cache"]
    assert stats["hit_tokens"] > 0.3 * stats["query_tokens"], stats
    gauge = re.search(rf"^{re.escape(metric_name('prefix_cache_pages'))}{{[^}}]*}} (\S+)$", on["metrics"], re.M)
    assert gauge and float(gauge.group(1)) == loads["kv_pages_cached"]
    assert off["loads"]["kv_pages_free"] == 6 and off["loads"]["kv_pages_cached"] == 0
