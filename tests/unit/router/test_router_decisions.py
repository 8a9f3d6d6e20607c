"""The router's decisions as pure functions (and the admission gate on a bare event loop):
admission, pool sizing, health after a check, body hygiene, first-event errors, who may admin."""

from __future__ import annotations

import asyncio
import json

import pytest

from dsv4_router.admission import Admission, Overloaded, Slot, decide
from dsv4_router.body import MAX_DEPTH, parse_body, read_limited
from dsv4_router.relay import first_event_error, split_events
from dsv4_router.workers import UNANSWERED_CHECKS, Worker, health_after_check
from dsv4_wire import is_loopback
from dsv4_router.upstream import plan_pools
from dsv4_wire import APIError


def test_decide_admits_queues_then_rejects():
    assert decide(0, 2, 0, 1) == "admit"
    assert decide(2, 2, 0, 1) == "queue"
    assert decide(1, 2, 1, 1) == "reject"  # a free slot never lets a newcomer jump the queue
    assert decide(1, 2, 0, 0) == "admit"
    assert decide(2, 2, 0, 0) == "reject"


def test_data_pools_cover_every_admitted_request():
    for n in (1, 4, 256, 1000):
        assert plan_pools(n).data_connections >= n  # an admitted request never waits for a connection
        assert plan_pools(n).control_connections >= 8


async def test_admission_hands_slots_over_in_order_and_times_out():
    gate = Admission(max_inflight=1, max_queue=2, queue_timeout=0.3)
    await gate.acquire()
    order: list[int] = []

    async def waiter(i: int) -> None:
        await gate.acquire()
        order.append(i)

    w1, w2 = asyncio.create_task(waiter(1)), asyncio.create_task(waiter(2))
    await asyncio.sleep(0.01)
    assert gate.queued == 2
    with pytest.raises(Overloaded) as full:
        await gate.acquire()  # queue full: refused at once
    assert full.value.retry_after >= 1
    gate.release()
    await asyncio.wait_for(w1, 1)
    assert order == [1] and gate.inflight == 1
    gate.release()
    await asyncio.wait_for(w2, 1)
    assert order == [1, 2]
    with pytest.raises(Overloaded):  # nobody releases: the wait ends in a refusal, not a hang
        await asyncio.wait_for(gate.acquire(), 2)
    assert gate.queued == 0 and gate.inflight == 1 and gate.rejected == 2
    gate.release()
    assert gate.inflight == 0


async def test_a_client_leaving_the_queue_frees_its_place():
    gate = Admission(max_inflight=1, max_queue=1, queue_timeout=5)
    await gate.acquire()
    t = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0.01)
    t.cancel()
    await asyncio.gather(t, return_exceptions=True)
    assert gate.queued == 0
    gate.release()
    assert gate.inflight == 0
    slot = Slot(gate)
    await slot.acquire()
    slot.release()
    slot.release()  # idempotent
    assert gate.inflight == 0


def test_health_only_the_engines_own_answer_or_a_dead_connection_counts():
    up = Worker("http://w", "decode", healthy=True, reason="ready")
    assert health_after_check(up, 200, "", False) == (True, "ready", 0)
    assert health_after_check(up, 503, "draining", False)[:2] == (False, "draining")
    assert health_after_check(up, None, "unreachable: ConnectError", True)[0] is False  # process gone
    slow = up
    for i in range(1, UNANSWERED_CHECKS):  # a busy engine is not a dead one
        healthy, _, slow.failures = health_after_check(slow, None, "no answer", False)
        assert healthy, i
    assert health_after_check(slow, None, "no answer", False)[0] is False
    down = Worker("http://w", "decode", healthy=False, reason="unreachable", failures=5)
    assert health_after_check(down, 200, "", False) == (True, "ready", 0)  # the next /ready restores it


@pytest.mark.parametrize(
    "raw",
    [
        b'{"temperature": NaN}',
        b'{"temperature": Infinity}',
        b'{"top_p": -Infinity}',
        b'{"temperature": 1e400}',
        b'{"max_tokens": ' + b"9" * 5000 + b"}",
        b"[1]",
        b'"x"',
        b"{nope",
        b"\xff\xfe",
        b'{"a": ' + b"[" * 100000 + b"]" * 100000 + b"}",
        b'{"a": ' + b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1) + b"}",
    ],
)
def test_hostile_bodies_are_400(raw):
    with pytest.raises(APIError) as e:
        parse_body(raw)
    assert e.value.status == 400 and e.value.body()["error"]["message"]


def test_ordinary_bodies_pass():
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "temperature": 0.7,
        "max_tokens": 10**6,
        "logit_bias": {"5": -100},
    }
    assert parse_body(json.dumps(body).encode()) == body


async def _chunks(*parts: bytes):
    for p in parts:
        yield p


async def test_body_size_limit_from_header_or_while_reading():
    with pytest.raises(APIError) as e:
        await read_limited("1000", _chunks(b"x"), 100)
    assert e.value.status == 413
    with pytest.raises(APIError) as e:
        await read_limited(None, _chunks(b"x" * 60, b"x" * 60), 100)
    assert e.value.status == 413
    assert await read_limited("4", _chunks(b"ab", b"cd"), 100) == b"abcd"


def test_first_event_error():
    assert first_event_error(b'data: {"choices": [{"text": "\\"error\\""}]}') is None
    assert first_event_error(b'data: {"error": {"message": "x"}}') == b'{"error": {"message": "x"}}'
    assert first_event_error(b"data: [DONE]") == b""  # ended before anything: a failure too
    assert first_event_error(b"junk") == b""


def test_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("127.8.0.1")
    assert not is_loopback("10.0.0.1") and not is_loopback(None) and not is_loopback("testclient")


def test_only_whole_events_are_relayed():
    assert split_events(b'data: {"a": 1}\n\ndata: {"b"') == (b'data: {"a": 1}\n\n', b'data: {"b"')
    assert split_events(b"data: {") == (b"", b"data: {")
    assert split_events(b"data: 1\n\ndata: 2\n\n") == (b"data: 1\n\ndata: 2\n\n", b"")
