"""stall_long_context: the injector decides by context length, a stall ends on clear() or after
its seconds, and `--arm-fault` text parses to what /admin/faults would arm."""

from __future__ import annotations

import threading
import time

import pytest

from dsv4_engine.pd.fault_names import STALL_DEFAULT_TOKENS, parse_arm_fault
from dsv4_engine.pd.faults import FaultInjector


def test_stalls_only_past_the_threshold():
    f = FaultInjector()
    f.arm("stall_long_context", -1, tokens=100)
    assert f.long_context_stall([10, 100]) is None  # "passes N": 100 is not past 100
    assert f.long_context_stall([]) is None
    got = f.long_context_stall([10, 101])
    assert got is not None and got["tokens"] == 100
    assert f.active("stall_long_context")  # -1: armed until cleared


def test_default_threshold_and_count():
    f = FaultInjector()
    f.arm("stall_long_context", 1)
    assert f.long_context_stall([STALL_DEFAULT_TOKENS]) is None
    assert f.long_context_stall([STALL_DEFAULT_TOKENS + 1]) is not None
    assert not f.active("stall_long_context")  # the one use is spent
    assert f.long_context_stall([10**6]) is None


def test_hang_ends_on_clear():
    f = FaultInjector()
    threading.Timer(0.2, f.clear).start()
    started = time.monotonic()
    hung = f.hang(None, poll_s=0.01)
    assert 0.15 < hung < 2.0 and time.monotonic() - started < 2.0


def test_hang_ends_after_its_seconds():
    assert 0.1 <= FaultInjector().hang(0.1, poll_s=0.01) < 1.0


@pytest.mark.parametrize(
    "text,want",
    [
        ("stall_long_context", ("stall_long_context", -1, {})),
        ("stall_long_context:tokens=300", ("stall_long_context", -1, {"tokens": 300})),
        (
            "stall_long_context:tokens=300,seconds=2.5,count=3",
            ("stall_long_context", 3, {"tokens": 300, "seconds": 2.5}),
        ),
        ("corrupt_transfer:state=swa_kv", ("corrupt_transfer", -1, {"state": "swa_kv"})),
    ],
)
def test_parse_arm_fault(text, want):
    assert parse_arm_fault(text) == want


@pytest.mark.parametrize(
    "text,says",
    [
        ("stall_everything", "unknown fault"),
        ("stall_long_context:tokens", "not key=value"),
        ("stall_long_context:count=0", "count"),
    ],
)
def test_parse_arm_fault_refuses(text, says):
    with pytest.raises(ValueError, match=says):
        parse_arm_fault(text)
