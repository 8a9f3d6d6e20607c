"""Hundreds of random requests with random aborts on a small pool: every page comes back."""

from __future__ import annotations

import random
import threading
import time

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence


def test_pages_return_after_random_requests_and_aborts(tiny_model):
    engine = Engine(
        EngineArgs(
            model=str(tiny_model),
            device="cpu",
            kernel_backend="cpu",
            kv_pages=40,
            page_size=8,
            max_num_seqs=16,
            max_num_batched_tokens=96,
        )
    )
    rng = random.Random(0)
    done = threading.Event()
    finished: dict[str, str] = {}
    lock = threading.Lock()
    n = 240

    def sink(out):
        if out.finished:
            with lock:
                finished[out.rid] = out.finish_reason
                if len(finished) == n:
                    done.set()

    engine.start()
    try:
        for i in range(n):
            prompt = [rng.randrange(2, 500) for _ in range(rng.randint(1, 60))]
            params = SamplingParams(
                max_tokens=rng.randint(1, 40),
                temperature=rng.choice([0, 0.8]),
                ignore_eos=rng.random() < 0.5,
                seed=rng.randint(0, 99),
            )
            engine.submit(Sequence(f"r{i}", prompt, params, sink=sink))
            if rng.random() < 0.3:
                engine.abort(f"r{rng.randint(max(0, i - 5), i)}")
            if rng.random() < 0.1:
                time.sleep(0.01)
        assert done.wait(240), f"only {len(finished)} of {n} requests finished"
        deadline = time.monotonic() + 5
        while engine.pool.allocator.num_free != engine.pool.num_pages and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.pool.allocator.num_free == engine.pool.num_pages
        assert not engine.seqs and not engine.scheduler.running and not engine.scheduler.waiting
        reasons = set(finished.values())
        assert "abort" in reasons and reasons <= {"abort", "length", "stop"}
    finally:
        engine.stop()
