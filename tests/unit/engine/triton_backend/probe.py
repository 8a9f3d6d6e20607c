"""Run by test_triton_backend.py in a fresh process: TRITON_INTERPRET must be set before
triton is first imported, so the triton backend can run on CPU through the interpreter.
Prints, as JSON, each backend's logits for a few mixed prefill/decode steps."""

import os
import sys
import time
import json

os.environ["TRITON_INTERPRET"] = "1"
import torch
from dsv4_engine.kv_cache import KVPool
from dsv4_engine.model_runner import ModelRunner
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.scheduler import Scheduler
from dsv4_engine.sequence import Sequence

model = sys.argv[1]
out = {}
for backend in ("torch", "triton"):
    t0 = time.time()
    r = ModelRunner(model, "float32", "cpu", backend)
    pool = KVPool(r.state_specs, 8, 16, torch.float32, torch.device("cpu"))
    sch = Scheduler(pool.allocator, 16, 4, 64)
    seqs = [
        Sequence("a", [5, 17, 42, 99, 7, 300, 12, 8, 77], SamplingParams(max_tokens=4, temperature=0)),
        Sequence("b", [9, 3, 250], SamplingParams(max_tokens=4, temperature=0)),
    ]
    for s in seqs:
        sch.add(s)
    steps = []
    for _ in range(3):
        b = sch.schedule()
        logits = r.forward(b, pool)
        for x, row in zip(b, logits):
            x.seq.num_computed += x.num_new
            x.seq.output_ids.append(int(row.argmax()))
        steps.append(logits.tolist())
    out[backend] = {"steps": steps, "tokens": [s.output_ids for s in seqs], "seconds": time.time() - t0}
print(json.dumps(out))
