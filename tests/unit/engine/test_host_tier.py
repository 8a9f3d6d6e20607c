"""The host tier under the prefix cache, in a real tiny engine (CPU): a pool too small for the
working set pushes pages down to host memory, a later round finds them there (cached tokens
from the host tier, events per tier) instead of recomputing them, and greedy outputs equal an
engine without the tier, token for token."""

from __future__ import annotations

import pytest
import torch

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.host_tier import host_tier_refusal
from dsv4_engine.kv_journal import KVJournal
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence
from dsv4_wire import kv_events as wire

PAGE = 16


def prompts() -> list[list[int]]:
    return [[(31 * k + 5 * i) % 400 + 20 for i in range(4 * PAGE + 3)] for k in range(6)]


def run(engine: Engine, rid: str, prompt: list[int]) -> Sequence:
    """One request to its end, stepping the engine by hand."""
    s = Sequence(rid, prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.submit(s)
    for _ in range(500):
        engine.step()
        if s.finished:
            return s
    raise AssertionError("engine made no progress")


def rounds(engine: Engine, first: list[list[int]] | None = None) -> tuple[list[list[int]], list[int]]:
    """Two rounds over 6 conversations (round 2: round 1's prompt + answer + a new turn)."""
    firsts = [p + run(engine, f"r1-{k}", p).output_ids for k, p in enumerate(first or prompts())]
    seconds = [run(engine, f"r2-{k}", p + [7, 8, 9]) for k, p in enumerate(firsts)]
    return [list(s.output_ids) for s in seconds], [s.num_cached_tokens for s in seconds]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
def test_evicted_pages_come_back_from_host_and_outputs_do_not_change(tiny_model, device):
    # on CUDA: the host pool is pinned and every copy non_blocking on the step's stream
    args = dict(model=str(tiny_model), device=device, kv_pages=14, page_size=PAGE, max_num_seqs=2)
    if device == "cpu":
        args["kernel_backend"] = "cpu"
    plain = Engine(EngineArgs(**args))
    want, plain_hits = rounds(plain)
    tiered = Engine(EngineArgs(**args, host_cache_gb=0.01))
    journal = tiered.prefix_cache.journal = KVJournal("t")
    tiered.prefix_cache.host.on_evict = lambda h: journal.evicted("host", h)
    got, hits = rounds(tiered)
    assert got == want
    # a 14-page pool holds ~3 of the 6 conversations: without the tier most of round 2 recomputes
    assert sum(hits) > sum(plain_hits) and min(hits) >= 4 * PAGE, (hits, plain_hits)
    tiers = tiered._tiers()
    assert tiers["host"]["restored"] > 0 and tiers["host"]["hit_tokens"] > 0
    snap = journal.snapshot()["tiers"]
    assert snap["host"] and set(snap["device"]) == {n.hash.hex() for n in tiered.prefix_cache._by_page.values()}
    assert {h.hex() for h in wire.page_hashes(prompts()[0], PAGE)} <= set(snap["host"]) | set(snap["device"])
    tiered.prefix_cache.check()
    if device == "cuda":
        assert all(t.is_pinned() for t in tiered.prefix_cache.host.states.values())


def test_the_tier_is_refused_where_it_cannot_serve():
    assert host_tier_refusal(0, 4, "off") is None
    assert "--tp-size" in host_tier_refusal(1, 2, None)
    assert "prefix cache" in host_tier_refusal(1, 1, "a decode engine receives every page")


def test_v4_resumes_from_host_pages_and_snapshots_with_equal_outputs(make_model):
    """DeepSeek-V4 (v4-tiny: window 8, CSA every 4, HCA every 8; pages of 4, boundary 8): the
    snapshot of a boundary goes down with its page, and a request resumes from the host at the
    deepest boundary holding both; outputs equal an engine without any cache."""
    v4 = make_model("v4-tiny")
    common = dict(
        model=str(v4), device="cpu", kernel_backend="cpu", page_size=4, max_num_seqs=2, max_num_batched_tokens=64
    )
    want, _ = rounds(Engine(EngineArgs(**common, kv_pages=64, enable_prefix_cache=False)), v4_prompts())
    plain = Engine(EngineArgs(**common, kv_pages=40, prefix_cache_snapshots=8))
    _, plain_hits = rounds(plain, v4_prompts())
    tiered = Engine(EngineArgs(**common, kv_pages=40, prefix_cache_snapshots=8, host_cache_gb=0.01))
    got, hits = rounds(tiered, v4_prompts())
    assert got == want
    host = tiered._tiers()["host"]
    assert host["snapshots_restored"] > 0 and host["hit_tokens"] > 0, host
    assert sum(hits) > sum(plain_hits), (hits, plain_hits)
    tiered.prefix_cache.check()


def v4_prompts() -> list[list[int]]:
    return [[(31 * k + 5 * i) % 300 + 20 for i in range(27)] for k in range(6)]


def test_host_hits_count_only_for_admitted_requests():
    """An attach that takes pages from the host, then fails admission (no room for the rest),
    counts no host hit: hits per tier never exceed the cache's own hit count (before the fix the
    device tier's counter was decremented, which Prometheus refuses)."""
    from dsv4_engine.host_tier import HostTier
    from dsv4_engine.kv_cache import PageAllocator
    from dsv4_engine.prefix_cache import PrefixCache

    ps, alloc = 4, PageAllocator(6)
    cache = PrefixCache(alloc, ps)
    cache.host = HostTier({"kv": torch.zeros(6, 8)}, 16)
    toks = list(range(100, 117))

    def admit(rid: str, count: bool) -> int:
        s = Sequence(rid, list(toks), SamplingParams(max_tokens=1))
        hit = cache.attach(s)
        if count:
            cache.count(s.num_tokens, hit)
            s.pages.extend(alloc.allocate(-(-s.num_tokens // ps) - len(s.pages)))
            s.num_computed = s.num_tokens
            cache.insert(s)
        alloc.free(s.pages)
        s.pages = []
        cache.forget(s)
        return hit

    admit("a", True)  # 4 full pages cached on the device
    alloc.free(alloc.allocate(6))  # pushes all of them down to the host
    assert cache.num_cached == 0 and cache.host.num_used == 4
    assert admit("b", False) == 16  # promoted back, but not admitted
    assert cache.host.hit_tokens == 0
    alloc.free(alloc.allocate(6))
    assert admit("c", True) == 16 and cache.host.hit_tokens == 16 == cache.hit_tokens
