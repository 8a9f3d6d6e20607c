"""The router's index of the fleet's caches, fed as the engines' event streams would feed it:
snapshot then batches; batches duplicated, reordered, lost; a restarted engine; a stalled stream.
Pure: no I/O, the clock is an argument."""

from __future__ import annotations

import pytest

from dsv4_router.cache_events import (
    CacheEvents,
    CacheSnapshot,
    Change,
    Heartbeat,
    Unreadable,
    from_wire,
    prompt_hashes,
)
from dsv4_router.cache_index import RESYNC, CacheIndex
from dsv4_router.scoring import Match
from dsv4_wire import kv_events as wire

TOKENS = list(range(1, 65))  # 4 pages of 16
H = prompt_hashes(TOKENS, 16)  # the contract's hashes, as the stream spells them


def stored(seq, hashes, tier="device", inst="a"):
    return CacheEvents(inst, seq, (Change("stored", tier, tuple(hashes)),))


def evicted(seq, hashes, tier="device", inst="a"):
    return CacheEvents(inst, seq, (Change("evicted", tier, tuple(hashes)),))


def fresh_index(**kw) -> CacheIndex:
    idx = CacheIndex(stale_after=10.0, gap_timeout=1.0, **kw)
    idx.snapshot("w1", CacheSnapshot("a", 0, {}, page_size=16, boundary_tokens=16), 0.0)
    return idx


def test_the_chain_is_the_contracts_and_a_salt_is_another_namespace():
    assert H == [h.hex() for h in wire.page_hashes(TOKENS, 16)]
    assert len(H) == 4 and prompt_hashes(TOKENS[:63], 16) == H[:3]  # a partial page has no hash
    assert prompt_hashes(TOKENS, 16, salt="tenant-b")[0] != H[0]
    assert prompt_hashes(TOKENS, 16, boundary=32) == [h.hex() for h in wire.page_hashes(TOKENS, 16, 32)]


def test_snapshot_then_deltas_give_the_longest_held_prefix_by_tier():
    idx = CacheIndex()
    idx.snapshot("w1", CacheSnapshot("a", 5, {"device": H[:2], "host": H[2:3]}, 16, 16), 0.0)
    assert idx.match(H, ["w1"], 1.0) == {"w1": Match(device=2, host=1)}
    idx.event("w1", stored(6, H[3:], "disk"), 1.0)
    assert idx.match(H, ["w1"], 1.0) == {"w1": Match(device=2, host=1, disk=1)}
    idx.event("w1", evicted(7, H[1:2]), 1.0)  # a hole: the prefix ends before it
    assert idx.match(H, ["w1"], 1.0) == {"w1": Match(device=1)}
    # a page held in two tiers counts at the better one
    idx.event("w1", CacheEvents("a", 8, (Change("stored", "host", (H[0],)),)), 1.0)
    assert idx.match(H, ["w1"], 1.0)["w1"] == Match(device=1)


def test_duplicates_and_old_batches_change_nothing():
    idx = fresh_index()
    idx.event("w1", stored(1, H[:2]), 0.1)
    idx.event("w1", evicted(2, H[:2]), 0.2)
    assert idx.event("w1", stored(1, H[:2]), 0.3) is None  # a replay of batch 1
    assert idx.match(H, ["w1"], 0.3)["w1"] == Match()
    assert idx.fresh("w1", 0.3)


def test_a_reordered_batch_waits_for_the_gap_and_the_worker_is_load_only_meanwhile():
    idx = fresh_index()
    idx.event("w1", stored(2, H[1:2]), 0.1)  # batch 1 is late
    assert not idx.fresh("w1", 0.2) and idx.match(H, ["w1"], 0.2)["w1"] == Match()
    idx.event("w1", stored(1, H[:1]), 0.3)
    assert idx.fresh("w1", 0.4) and idx.match(H, ["w1"], 0.4)["w1"] == Match(device=2)


def test_a_lost_batch_drops_the_workers_pages_until_a_new_snapshot():
    idx = fresh_index()
    idx.event("w1", stored(1, H[:2]), 0.1)
    idx.event("w1", evicted(3, H[:1]), 0.2)  # batch 2 never comes
    assert idx.tick(0.5) == []  # within the gap timeout: waiting
    assert idx.tick(1.5) == ["w1"]  # lost: the claims cannot be vouched for
    assert not idx.fresh("w1", 1.5) and idx.workers["w1"].pages["device"] == set()
    assert idx.view("w1", 1.5)["events_lost"] == 1
    idx.snapshot("w1", CacheSnapshot("a", 3, {"device": H[1:2]}, 16, 16), 1.6)
    assert idx.fresh("w1", 1.7) and idx.match(H, ["w1"], 1.7)["w1"] == Match()  # H[0] is not held


def test_too_many_batches_past_a_gap_is_a_loss_at_once():
    idx = fresh_index(reorder_window=3)
    assert [idx.event("w1", stored(s, H[:1]), 0.1) for s in range(2, 6)][-1] == RESYNC


def test_a_heartbeat_past_what_arrived_opens_a_gap():
    idx = fresh_index()
    idx.event("w1", stored(1, H[:1]), 0.1)
    idx.event("w1", Heartbeat("a", 2), 0.2)  # batch 2 was sent
    assert not idx.fresh("w1", 0.3)
    idx.event("w1", stored(2, H[1:2]), 0.4)
    assert idx.fresh("w1", 0.5) and idx.match(H, ["w1"], 0.5)["w1"] == Match(device=2)


def test_a_restarted_engine_starts_empty_whatever_it_held():
    idx = fresh_index()
    idx.event("w1", stored(1, H), 0.1)
    # the new process's stream: another instance; nothing of the old one is kept
    assert idx.event("w1", stored(1, H[:1], inst="b"), 0.2) == RESYNC
    assert idx.match(H, ["w1"], 0.2)["w1"] == Match() and not idx.fresh("w1", 0.2)
    idx.snapshot("w1", CacheSnapshot("b", 0, {}, 16, 16), 0.3)  # the batch that came first is applied after it
    assert idx.match(H, ["w1"], 0.4)["w1"] == Match(device=1)
    assert idx.view("w1", 0.4)["restarts"] == 1


def test_a_cleared_tier_is_gone():
    idx = fresh_index()
    idx.event("w1", CacheEvents("a", 1, (Change("stored", "device", tuple(H)), Change("stored", "host", tuple(H)))), 0)
    idx.event("w1", CacheEvents("a", 2, (Change("cleared", "device"),)), 0)
    assert idx.match(H, ["w1"], 0.1)["w1"] == Match(host=4)
    assert idx.workers["w1"].pages["device"] == set()


def test_a_stalled_stream_makes_the_worker_load_only_and_a_heartbeat_brings_it_back():
    idx = fresh_index()
    idx.event("w1", stored(1, H), 0.0)
    assert idx.fresh("w1", 9.0)
    assert not idx.fresh("w1", 10.5) and idx.match(H, ["w1"], 10.5)["w1"] == Match()
    idx.event("w1", Heartbeat("a", 1), 11.0)
    assert idx.match(H, ["w1"], 11.0)["w1"] == Match(device=4)


def test_one_walk_serves_every_worker_and_a_removed_worker_leaves_no_trace():
    idx = fresh_index()
    idx.snapshot("w2", CacheSnapshot("x", 0, {"device": H[:3]}, 16, 16), 0.0)
    idx.event("w1", stored(1, H[:1]), 0.0)
    assert idx.match(H, ["w1", "w2", "w3"], 0.1) == {"w1": Match(device=1), "w2": Match(device=3), "w3": Match()}
    idx.remove("w2")
    assert idx.match(H, ["w1", "w2"], 0.1)["w2"] == Match() and all("w2" not in v for v in idx.holders.values())
    idx.remove("w1")
    assert idx.holders == {}


def test_wire_messages_map_onto_the_index():
    snap = from_wire(
        wire.decode(
            wire.encode(
                wire.snapshot_message(
                    "i", 4, {"device": H[:2]}, model="m", role="mono", page_size=16, boundary_tokens=16
                )
            )
        )
    )
    assert snap == CacheSnapshot("i", 4, {"device": tuple(sorted(H[:2])), "host": (), "disk": ()}, 16, 16)
    batch = from_wire(
        wire.decode(
            wire.encode(
                wire.events_message("i", 5, [wire.Event("stored", "host", (H[2],)), wire.Event("cleared", "disk")], 1.0)
            )
        )
    )
    assert batch == CacheEvents("i", 5, (Change("stored", "host", (H[2],)), Change("cleared", "disk")))
    assert from_wire(wire.decode(wire.encode(wire.heartbeat_message("i", 5)))) == Heartbeat("i", 5)
    with pytest.raises(Unreadable):
        from_wire({"v": 2, "type": "snapshot"})
    # the reference reader and the index agree on what a stream says
    view, idx = wire.EngineView(), CacheIndex()
    msgs = [
        wire.snapshot_message("i", 0, {}, model="m", role="mono", page_size=16, boundary_tokens=16),
        wire.events_message("i", 1, [wire.Event("stored", "device", tuple(H))], 1.0),
        wire.events_message(
            "i", 2, [wire.Event("evicted", "device", (H[3],)), wire.Event("stored", "host", (H[3],))], 2.0
        ),
    ]
    for m in msgs:
        assert view.apply(m)
        got = from_wire(m)
        (idx.snapshot if isinstance(got, CacheSnapshot) else idx.event)("w", got, 2.0)
    assert view.matched_pages(H) == idx.match(H, ["w"], 2.0)["w"].pages == 4
