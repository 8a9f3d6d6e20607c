"""The router's subscription to an engine's /v1/kv_events over real HTTP on 127.0.0.1: a server
that speaks the contract (dsv4_wire.kv_events' own message builders) stands where an engine
will, so the client's I/O is tested on its own: snapshot then batches, a lost batch and a new
instance make it subscribe again, a stalled stream is cut, an engine without the endpoint is
scored on load alone. Placement then follows what the index holds."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from dsv4_router.cache_events import prompt_hashes
from dsv4_router.cache_index import CacheIndex
from dsv4_router.cache_placement import CachePlacement, prompt_ids
from dsv4_router.cache_subscriber import CacheSubscriber
from dsv4_router.workers import Worker
from dsv4_wire import Paths
from dsv4_wire import kv_events as wire

TOKENS = list(range(100, 164))  # 4 pages of 16
H = prompt_hashes(TOKENS, 16)


class EventServer:
    """Serves scripted subscriptions: each GET gets the next script (a list of messages, or a
    pause in seconds), then holds the stream open."""

    def __init__(self, scripts):
        self.scripts = list(scripts)
        self.subscriptions = 0
        self.done = asyncio.Event()

    async def handle(self, request):
        self.subscriptions += 1
        if not self.scripts:
            return web.Response(status=503)
        script = self.scripts.pop(0)
        if script == 404:
            return web.Response(status=404)
        resp = web.StreamResponse(headers={"content-type": wire.CONTENT_TYPE})
        await resp.prepare(request)
        for item in script:
            if isinstance(item, (int, float)):
                await asyncio.sleep(item)
            else:
                await resp.write(wire.encode(item))
        try:
            await asyncio.wait_for(self.done.wait(), 30)
        except asyncio.TimeoutError:
            pass
        return resp


async def serve(server: EventServer):
    app = web.Application()

    async def release(_app) -> None:
        server.done.set()

    app.on_shutdown.append(release)
    app.router.add_get(Paths.KV_EVENTS, server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def snap(inst, seq, tiers):
    return wire.snapshot_message(inst, seq, tiers, model="m", role="mono", page_size=16, boundary_tokens=16)


def batch(inst, seq, *events):
    return wire.events_message(inst, seq, list(events), time.time())


async def until(cond, timeout=5.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        await asyncio.sleep(0.02)


async def test_snapshot_deltas_resync_and_restart_over_http():
    server = EventServer(
        [
            # first subscription: a snapshot, a batch, then batch 3 without 2 (lost) ...
            [
                snap("a", 0, {"device": H[:1]}),
                batch("a", 1, wire.Event("stored", "device", tuple(H[1:3]))),
                0.3,
                batch("a", 3, wire.Event("stored", "device", (H[3],))),
            ],
            # ... so it subscribes again: a fresh snapshot
            [snap("a", 3, {"device": H[:2]})],
        ]
    )
    runner, url = await serve(server)
    index = CacheIndex(gap_timeout=0.2)
    sub = CacheSubscriber(index, stale_after=5.0)
    sub.start()
    try:
        sub.follow(url)
        await until(lambda: index.match(H, [url], time.monotonic())[url].pages == 3)
        await until(lambda: server.subscriptions == 2)  # the lost batch: dropped, then resubscribed
        await until(lambda: index.fresh(url, time.monotonic()))
        assert index.match(H, [url], time.monotonic())[url].pages == 2
        assert index.view(url, time.monotonic())["events_lost"] == 1
    finally:
        await sub.aclose()
        await runner.cleanup()


async def test_a_new_instance_a_stall_and_a_missing_endpoint():
    server = EventServer(
        [
            [snap("a", 0, {"device": H})],  # then silence: the stream stalls
            [snap("b", 0, {})],  # the engine restarted meanwhile: it holds nothing
        ]
    )
    runner, url = await serve(server)
    index = CacheIndex(stale_after=0.5)
    sub = CacheSubscriber(index, stale_after=0.5)
    sub.start()
    none_runner, none_url = await serve(EventServer([404]))
    try:
        sub.follow(url)
        sub.follow(none_url)
        await until(lambda: index.match(H, [url], time.monotonic())[url].pages == 4)
        await until(lambda: server.subscriptions == 2, timeout=8.0)  # cut after stale_after, then again
        await until(lambda: index.view(url, time.monotonic()).get("instance") == "b")
        assert index.match(H, [url], time.monotonic())[url].pages == 0
        await until(lambda: (sub.status.get(none_url) or "").startswith("no events"))
        assert not index.fresh(none_url, time.monotonic())
        sub.drop(url)
        assert url not in index.workers
    finally:
        await sub.aclose()
        await runner.cleanup()
        await none_runner.cleanup()


def test_placement_follows_the_index_and_falls_back_without_it():
    index = CacheIndex()
    place = CachePlacement(index, clock=lambda: 1.0)
    a, b, c = Worker("http://a", "mono"), Worker("http://b", "mono"), Worker("http://c", "mono")
    ids = prompt_ids("/v1/completions", {"prompt": TOKENS + [1, 2, 3]})
    assert ids == TOKENS + [1, 2, 3] and prompt_ids("/v1/chat/completions", {"messages": []}) is None
    assert place.pick([a, b, c], ids, None, "k") is None  # nobody publishes events: the caller's affinity
    index.snapshot(b.url, wire_snapshot(H[:3]), 1.0)
    index.snapshot(c.url, wire_snapshot(H[:1]), 1.0)
    assert place.pick([a, b, c], ids, None, "k").url == b.url
    # another namespace (a tenant's salt) shares no page with the shared one
    salted = place.matches(ids, "tenant", [a, b, c])
    assert all(m.pages == 0 for m in salted.values())
    # b much busier than the saving is worth: elsewhere
    b.load_tokens = 10_000_000
    assert place.pick([a, b, c], ids, None, "k").url != b.url
    b.load_tokens = 0
    # a session returns to its last worker when costs tie
    d = Worker("http://d", "mono")
    first = place.pick([a, d], [1, 2, 3], None, "s", session="s1")
    assert all(place.pick([a, d], [1, 2, 3], None, f"other{i}", session="s1") is first for i in range(5))


def wire_snapshot(hashes):
    from dsv4_router.cache_events import from_wire

    return from_wire(snap("x", 0, {"device": hashes}))


@pytest.mark.parametrize("replicas", [3])
def test_router_replicas_fed_the_same_streams_choose_alike(replicas):
    """Each replica keeps its own index from the same events: no talk between them, same picks."""
    import random

    rng = random.Random(5)
    msgs = {f"http://e{i}": [snap(f"i{i}", 0, {})] for i in range(4)}
    prompts = [[rng.randrange(1, 1000) for _ in range(16 * rng.randrange(3, 6))] for _ in range(30)]
    for i, url in enumerate(msgs):
        held = [h for p in prompts[i::4] for h in prompt_hashes(p, 16)]
        msgs[url].append(batch(f"i{i}", 1, wire.Event("stored", "device", tuple(held))))
    picks = []
    for _ in range(replicas):
        index = CacheIndex()
        from dsv4_router.cache_events import CacheSnapshot, from_wire

        for url, ms in msgs.items():
            for m in ms:
                got = from_wire(m)
                (index.snapshot if isinstance(got, CacheSnapshot) else index.event)(url, got, 0.0)
        place = CachePlacement(index, clock=lambda: 0.0)
        workers = [Worker(u, "mono") for u in msgs]
        picks.append([place.pick(workers, p, None, str(j)).url for j, p in enumerate(prompts)])
    assert all(p == picks[0] for p in picks)
    assert picks[0] == [f"http://e{j % 4}" for j in range(30)]  # each prompt goes where it is held
