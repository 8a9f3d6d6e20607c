"""DeepSeek-V4 on the engine thread: a couple of hundred random requests (random lengths across
window and compression boundaries, greedy and sampled, random aborts, more requests than slot
rows, a pool small enough to preempt) return every page and every slot row."""

from __future__ import annotations

import random
import threading
import time

import pytest

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_pages_and_slot_rows_return_after_random_requests_and_aborts(make_model):
    engine = Engine(
        EngineArgs(
            model=str(make_model("v4-tiny")),
            device="cpu",
            kernel_backend="cpu",
            kv_pages=30,
            page_size=4,
            max_num_seqs=6,
            max_num_batched_tokens=37,
        )
    )
    rng = random.Random(0)
    done = threading.Event()
    finished: dict[str, str] = {}
    lock = threading.Lock()
    n = 200

    def sink(out):
        if out.finished:
            with lock:
                finished[out.rid] = out.finish_reason
                if len(finished) == n:
                    done.set()

    seqs = []
    engine.start()
    try:
        for i in range(n):
            prompt = [rng.randrange(2, 500) for _ in range(rng.randint(1, 40))]
            params = SamplingParams(
                max_tokens=rng.randint(1, 24),
                temperature=rng.choice([0, 0.8]),
                ignore_eos=rng.random() < 0.5,
                seed=rng.randint(0, 99),
            )
            seqs.append(Sequence(f"r{i}", prompt, params, sink=sink))
            engine.submit(seqs[-1])
            if rng.random() < 0.3:
                engine.abort(f"r{rng.randint(max(0, i - 5), i)}")
            if rng.random() < 0.1:
                time.sleep(0.01)
        assert done.wait(300), f"only {len(finished)} of {n} requests finished"
        pool = engine.pool
        deadline = time.monotonic() + 5
        while (pool.allocator.num_free, pool.slots.num_free) != (pool.num_pages, pool.num_slots):
            assert time.monotonic() < deadline, (pool.allocator.num_free, pool.slots.num_free)
            time.sleep(0.01)
        assert not engine.seqs and not engine.scheduler.running and not engine.scheduler.waiting
        assert all(s.pages == [] and s.slot is None for s in seqs)
        reasons = set(finished.values())
        assert "abort" in reasons and reasons <= {"abort", "length", "stop"}
        assert sum(s.num_preemptions for s in seqs) > 0, "the small pool should have forced preemptions"
    finally:
        engine.stop()
