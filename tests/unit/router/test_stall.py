"""The stall rule (router/dsv4_router/stall.py), pure: when a request's silence makes its engine
a suspect."""

from __future__ import annotations

from dsv4_router.stall import STALL_FACTOR, Watched, patience
from dsv4_router.workers import Worker


def test_patience_is_the_floor_until_the_stream_has_a_pace():
    assert patience(3.0, 0, 0.0, 0.0) == 3.0
    assert patience(3.0, 1, 5.0, 5.0) == 3.0


def test_patience_follows_a_slow_streams_own_pace():
    # 11 events over 10 s: a gap of 1 s per token; 20 gaps of that are normal for it
    assert patience(3.0, 11, 0.0, 10.0) == STALL_FACTOR * 1.0
    # a fast stream keeps the floor
    assert patience(3.0, 101, 0.0, 1.0) == 3.0


def test_a_request_is_suspect_past_its_patience_and_once_per_period():
    w = Watched((Worker("http://d", "decode"),), lambda _: None, started_at=100.0)
    assert not w.suspect(102.9, 3.0)  # waiting for its first event: slow is not frozen
    assert w.suspect(103.1, 3.0)
    w.checked_at = 103.1  # checked, answered ready: left alone for another period
    assert not w.suspect(105.0, 3.0) and w.suspect(106.2, 3.0)
    for t in (110.0, 110.1, 110.2):
        w.event(t)
    assert not w.suspect(112.0, 3.0) and w.suspect(113.3, 3.0)  # silence counts from the last event
