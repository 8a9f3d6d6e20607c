"""PD with the prefill engine's prefix cache: a repeated prefix is served from prefill's cache,
decode still receives every page of the request (cached ones included) and generates exactly
what a monolithic engine without a cache generates."""

from __future__ import annotations

import random

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.pd.common import PDSettings
from dsv4_engine.pd.request_info import PDRequestInfo
from dsv4_engine.pd.decode import DecodeController
from dsv4_engine.pd.fake import FakeFabric
from dsv4_engine.pd.prefill import PrefillController
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence

BOOTSTRAP_ADDR = "http://127.0.0.1:9100"
DECODE_URL = "http://127.0.0.1:8200"
PAGES = 48


def make(model, role: str, cache: bool = True) -> Engine:
    return Engine(
        EngineArgs(
            model=str(model),
            role=role,
            device="cpu",
            kernel_backend="cpu",
            kv_pages=PAGES,
            page_size=8,
            served_model_name="m",
            enable_prefix_cache=cache,
            decode_local_prefill=0,  # prefill's cache and the whole state shipped (decode's own: pd/)
        )
    )


def run(engines: list[Engine], done, limit: int = 3000) -> None:
    for _ in range(limit):
        if done():
            return
        for e in engines:
            e.step() if (e.scheduler.has_work() or not e.inbox.empty() or (e.pd and e.pd.busy())) else (
                e.pd and e.pd.poll()
            )
    raise AssertionError("no progress")


def test_prefill_cache_hits_and_decode_gets_the_whole_state(tiny_model):
    p, d = make(tiny_model, "prefill"), make(tiny_model, "decode")
    mono = make(tiny_model, "mono", cache=False)
    assert p.prefix_cache is not None and d.prefix_cache is None
    fabric = FakeFabric()
    settings = PDSettings(bootstrap_timeout=30, transfer_timeout=30, waiting_timeout=30, url=DECODE_URL)
    p.pd = PrefillController(p, settings, fabric.transport("prefill-x", p.pool.states), fabric.channel(p.call))
    d.pd = DecodeController(d, settings, fabric.transport("decode-x", d.pool.states), fabric.channel(d.call))
    fabric.serve(BOOTSTRAP_ADDR, p.pd, "prefill")
    fabric.serve(DECODE_URL, d.pd, "decode")
    rng = random.Random(7)
    system = [rng.randrange(3, 400) for _ in range(37)]
    prompts = [system + [rng.randrange(3, 400) for _ in range(rng.randint(1, 9))] for _ in range(4)]
    got, want = {}, {}
    for room, prompt in enumerate(prompts, start=1):
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        ends = {}
        for side, eng in (("p", p), ("d", d)):
            s = Sequence(
                f"{side}{room}",
                list(prompt),
                params,
                sink=lambda o, side=side: (
                    got.setdefault(room, []).extend(o.token_ids) if side == "d" else None,
                    ends.__setitem__(side, o) if o.finished else None,
                ),
            )
            s.pd = PDRequestInfo("127.0.0.1", 9100, room)
            s.prefill_only = side == "p"
            eng.submit(s)
        run([p, d], lambda: "d" in ends and "p" in ends)
        assert ends["d"].finish_reason == "length" and ends["p"].error is None, (ends["d"].error, ends["p"].error)
        m = Sequence(f"m{room}", list(prompt), params, sink=lambda o: want.setdefault(room, []).extend(o.token_ids))
        mono.submit(m)
        run([mono], lambda: m.finished)
    assert got == want
    # Every request after the first reused the system prompt's 4 full pages on prefill.
    assert p.prefix_cache.hit_tokens == 3 * 32, p.prefix_cache.stats()
    assert p.metrics.totals["kv_transfers_completed"] == 4
    assert p.pool.allocator._refs == {} and d.pool.allocator._refs == {}
    assert p.pool.allocator.num_free == PAGES and d.pool.allocator.num_free == PAGES
