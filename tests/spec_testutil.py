"""Engines with and without MTP speculation, run to the end, and drafts steered right or wrong:
shared by the speculative-decoding tests."""

from __future__ import annotations

import random
import threading
import time
from typing import Callable, Union

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence


def spec_engine(model, spec: bool, steps: int = 3, kv_pages: int = 64, **kw) -> Engine:
    """A CPU engine over `model`, speculating `steps` drafts when `spec`."""
    args = dict(model=str(model), device="cpu", kernel_backend="cpu", kv_pages=kv_pages, page_size=8, max_num_seqs=8)
    args.update(kw)
    if spec:
        args.update(speculative_algorithm="mtp", speculative_num_steps=steps)
    return Engine(EngineArgs(**args))


def run_all(engine: Engine, requests: list[tuple[list[int], SamplingParams]], timeout: float = 120) -> dict:
    """rid -> (token ids, text, finish_reason, error); checks every page came back."""
    outs: dict = {}
    done = threading.Event()
    lock = threading.Lock()

    def sink(o):
        with lock:
            toks, text, _, _ = outs.get(o.rid, ([], "", None, None))
            outs[o.rid] = (toks + list(o.token_ids), text + o.text, o.finish_reason, o.error)
            if o.finished and sum(v[2] is not None for v in outs.values()) == len(requests):
                done.set()

    engine.start()
    try:
        for i, (prompt, params) in enumerate(requests):
            engine.submit(Sequence(f"r{i}", prompt, params, sink=sink))
        assert done.wait(timeout), f"only {sum(v[2] is not None for v in outs.values())} finished"
        deadline = time.monotonic() + 5
        while engine.pool.allocator.num_free != engine.pool.num_pages and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.pool.allocator.num_free == engine.pool.num_pages, "pages not returned"
        assert not engine.seqs and not engine.scheduler.running
    finally:
        engine.stop()
    return outs


def steer(engine: Engine, reference: dict, accuracy: Union[float, dict[str, float]], seed: int = 0) -> None:
    """Replace each request's drafts, just before they are verified, by the reference's next
    tokens (right) or by other tokens (wrong), right with probability `accuracy` (one for all, or
    per request id): the verify, rollback and catch-up paths all run for real."""
    spec, rng = engine.spec, random.Random(seed)
    original = spec.lookahead
    chance: Callable[[str], float] = accuracy.__getitem__ if isinstance(accuracy, dict) else lambda _rid: accuracy

    def lookahead(seq):
        n = original(seq)
        if n:
            want = reference[seq.rid][0][len(seq.output_ids) :]
            d = spec.drafts[seq]
            for j in range(n):
                right = want[j] if j < len(want) else 7
                d.tokens[j] = right if rng.random() < chance(seq.rid) else (right + 1) % 500
        return n

    spec.lookahead = engine.scheduler.lookahead = lookahead
