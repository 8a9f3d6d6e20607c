"""Cached-but-idle KV pages (the prefix cache keeps them after their requests finished) are not
a wedge: a real engine holding most of its pool in the cache reads as free pages and, idle,
is Healthy for the whole detection window. DeepSeek-V4's cache also holds slot-row snapshots:
they take no request's slot row, and the engine reads the same."""

from __future__ import annotations

import dataclasses

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence
from dsv4_operator.watchdog.detector import Detector, Healthy
from dsv4_operator.watchdog.signals import build_sample


def test_an_idle_engine_full_of_cached_pages_is_healthy(tiny_model):
    engine = Engine(
        EngineArgs(model=str(tiny_model), role="prefill", device="cpu", kernel_backend="cpu", kv_pages=12, page_size=4)
    )
    ends = []
    for i in range(3):
        s = Sequence(f"r{i}", [10 + i] * 13, SamplingParams(max_tokens=1, temperature=0), sink=ends.append)
        engine.submit(s)
        while not s.finished:
            engine.step()
    assert engine.prefix_cache.num_cached == 9 and engine.prefix_cache.num_idle == 9
    assert engine.pool.allocator.num_unused == 3  # only 3 pages are neither used nor cached
    sample = build_sample(0.0, "prefill", metrics_text=engine.metrics.render().decode(), loads=engine.loads())
    assert sample.kv_pages_free == sample.kv_pages_total == 12
    detector = Detector(window_s=60.0)
    verdicts = [detector.observe("p-0", dataclasses.replace(sample, timestamp=float(t))) for t in range(0, 200, 5)]
    assert all(isinstance(v, Healthy) for v in verdicts), verdicts[-1]


def test_an_idle_v4_engine_holding_pages_and_snapshots_is_healthy(make_model):
    engine = Engine(
        EngineArgs(
            model=str(make_model("v4-tiny")),
            role="prefill",
            device="cpu",
            kernel_backend="cpu",
            kv_pages=12,
            page_size=4,
            max_num_seqs=2,
        )
    )
    for i in range(3):
        s = Sequence(f"r{i}", [10 + i] * 13, SamplingParams(max_tokens=1, temperature=0), sink=lambda out: None)
        engine.submit(s)
        while not s.finished:
            engine.step()
    stats = engine.prefix_cache.stats()
    assert engine.prefix_cache.num_cached == engine.prefix_cache.num_idle > 0 and stats["snapshots_cached"] > 0
    assert engine.pool.slots.num_free == engine.pool.slots.total
    sample = build_sample(0.0, "prefill", metrics_text=engine.metrics.render().decode(), loads=engine.loads())
    assert sample.kv_pages_free == sample.kv_pages_total == 12
    detector = Detector(window_s=60.0)
    verdicts = [detector.observe("p-0", dataclasses.replace(sample, timestamp=float(t))) for t in range(0, 200, 5)]
    assert all(isinstance(v, Healthy) for v in verdicts), verdicts[-1]
