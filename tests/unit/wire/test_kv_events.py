"""The KV-events contract (dsv4_wire.kv_events): the page hash and the stream's messages."""

from __future__ import annotations

import hashlib
import struct

import pytest

from dsv4_wire import kv_events as kv


def test_the_hash_is_the_documented_chain() -> None:
    # spelled out independently of the module: a subscriber in another language computes this
    root = hashlib.blake2b(b"dsv4-kv-v1\0tenant-a", digest_size=16).digest()
    h0 = hashlib.blake2b(root + struct.pack("<4I", 1, 2, 3, 4), digest_size=16).digest()
    h1 = hashlib.blake2b(h0 + struct.pack("<4I", 5, 6, 7, 8), digest_size=16).digest()
    assert kv.page_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, salt="tenant-a") == [h0, h1]
    assert kv.root_hash(None) == kv.root_hash("") == hashlib.blake2b(b"dsv4-kv-v1\0", digest_size=16).digest()


def test_equal_hashes_mean_equal_prefixes_and_salts_separate() -> None:
    a = kv.page_hashes(list(range(32)), 8)
    b = kv.page_hashes(list(range(16)) + [99] + list(range(17, 32)), 8)
    assert a[:2] == b[:2] and a[2] != b[2] and a[3] != b[3]  # a change poisons every later page
    assert kv.page_hashes(list(range(32)), 8, salt="x")[0] != a[0]
    assert kv.page_hashes(list(range(31)), 8) == a[:3]  # only full pages


def test_pages_shorter_than_the_boundary_key_on_tokens_up_to_it() -> None:
    # V4 with pages of 4 and a boundary of 8: page 0's key spans tokens 0..7 (as the engine's tree)
    assert kv.key_span(0, 4, 8) == (0, 8) and kv.key_span(1, 4, 8) == (4, 8) and kv.key_span(2, 4, 8) == (8, 16)
    a = kv.page_hashes(list(range(16)), 4, boundary=8)
    b = kv.page_hashes(list(range(6)) + [50, 51] + list(range(8, 16)), 4, boundary=8)
    assert len(a) == 4 and a[0] != b[0]  # page 0 differs through the later tokens of its boundary
    assert len(kv.page_hashes(list(range(15)), 4, boundary=8)) == 2  # the second boundary is not complete
    with pytest.raises(ValueError):
        kv.key_span(0, 4, 6)
    with pytest.raises(ValueError):
        kv.page_hashes([1, 2**32, 3, 4], 4)


def _h(n: int) -> str:
    return kv.hex_hash(kv.page_hashes(list(range(n * 4 + 4)), 4)[-1])


def test_stream_messages_round_trip_and_fold_into_a_view() -> None:
    snap = kv.snapshot_message(
        "inst1",
        3,
        {"device": [_h(0), _h(1)], "host": [_h(2)]},
        model="m",
        role="prefill",
        page_size=4,
        boundary_tokens=4,
    )
    view = kv.EngineView()
    assert view.apply(kv.decode(kv.encode(snap)))
    assert view.holds(_h(2)) == "host" and view.matched_pages([_h(0), _h(1), _h(2), _h(3)]) == 3
    ev = kv.events_message(
        "inst1",
        4,
        [kv.Event("evicted", "device", (_h(1),)), kv.Event("stored", "host", (_h(1),)), kv.Event("cleared", "disk")],
        ts=1.0,
    )
    line = kv.encode(ev)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert view.apply(kv.decode(line))
    assert view.holds(_h(1)) == "host" and view.holds(_h(0)) == "device"
    assert view.apply(kv.decode(kv.encode(kv.heartbeat_message("inst1", 4))))


def test_a_gap_another_instance_or_version_means_resync() -> None:
    view = kv.EngineView()
    view.apply(kv.snapshot_message("a", 0, {}, model="m", role="mono", page_size=4, boundary_tokens=4))
    assert not view.apply(kv.events_message("a", 2, [], ts=0.0))  # seq 1 missed
    assert not view.apply(kv.events_message("b", 1, [], ts=0.0))  # a restarted engine
    assert not view.apply(kv.decode(b'{"v": 2, "type": "events"}'))  # a newer stream
    assert not kv.EngineView().apply(kv.events_message("a", 1, [], ts=0.0))  # events before any snapshot


@pytest.mark.parametrize(
    "line",
    [
        b"not json",
        b"[1]",
        b'{"v": 1, "type": "nope", "instance": "a", "seq": 0}',
        b'{"v": 1, "type": "events", "instance": "", "seq": 0, "events": []}',
        b'{"v": 1, "type": "events", "instance": "a", "seq": -1, "events": []}',
        b'{"v": 1, "type": "events", "instance": "a", "seq": 1, "events": [{"kind": "stored", "tier": "gpu", "hashes": []}]}',
        b'{"v": 1, "type": "events", "instance": "a", "seq": 1, "events": [{"kind": "stored", "tier": "host", "hashes": ["xyz"]}]}',
        b'{"v": 1, "type": "events", "instance": "a", "seq": 1, "events": [{"kind": "evicted", "tier": "host"}]}',
        b'{"v": 1, "type": "snapshot", "instance": "a", "seq": 1, "tiers": {"device": []}, "page_size": 0, "boundary_tokens": 4}',
    ],
)
def test_malformed_messages_are_refused(line: bytes) -> None:
    with pytest.raises(ValueError):
        kv.decode(line)
