"""Graph capture at --tp-size > 1 agrees after every batch size (cuda_graphs.capture_buckets +
parallel.group.agree_failure): a failure on one rank ends capture on every rank at that size,
with the same one line naming the rank, instead of the others going on to warm-ups whose
all-reduces the failed rank never joins. Two real processes over gloo; rank 1 fails at 8. The
same processes agree on the tightest rank's free memory (what sizes every rank's KV pool)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from dsv4_engine.cuda_graphs import capture_buckets
from dsv4_engine.parallel.group import free_port

RANK = textwrap.dedent(
    """
    import json, sys, types
    import torch.distributed as dist
    from dsv4_engine.cuda_graphs import capture_buckets
    from dsv4_engine.kv_sizing import DeviceMemory
    from dsv4_engine.parallel.group import agree_failure, tightest_memory

    r, port = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2)
    rank = types.SimpleNamespace(control=None)
    done = []

    def one(bs):
        if r == 1 and bs == 8:
            raise RuntimeError("CUDA out of memory. Tried to allocate 1.00 GiB\\nmore")
        done.append(bs)

    out = capture_buckets([32, 16, 8, 4, 2, 1], one, lambda f: agree_failure(f, rank))
    # The pool's memory: the tightest rank's, on every rank (rank 1 has less free, rank 0 less total).
    mem = tightest_memory(DeviceMemory(free=(10 - 3 * r) << 30, total=(80 + r) << 30), rank)
    none = tightest_memory(None, rank)  # CPU ranks: nothing to size from
    print(json.dumps({"out": out, "done": done, "mem": [mem.free, mem.total], "none": none}), flush=True)
    dist.destroy_process_group()
    """
)


def test_a_failure_on_one_rank_ends_capture_on_every_rank_with_one_line():
    port = str(free_port())
    procs = [
        subprocess.Popen([sys.executable, "-c", RANK, str(r), port], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for r in (0, 1)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err.decode()
        results.append(json.loads(out.decode().strip().splitlines()[-1]))
    line = "rank 1: capturing the decode graph of batch size 8 failed: RuntimeError: CUDA out of memory. Tried to allocate 1.00 GiB"
    assert [r["out"] for r in results] == [line, line]
    assert results[0]["done"] == [32, 16, 8]  # rank 0 captured 8, then stopped with rank 1
    assert results[1]["done"] == [32, 16]
    assert [r["mem"] for r in results] == [[7 << 30, 80 << 30]] * 2 and [r["none"] for r in results] == [None, None]


def test_alone_the_first_failure_stops_capture():
    done = []

    def one(bs):
        if bs == 2:
            raise RuntimeError("capture-unsafe op")
        done.append(bs)

    assert (
        capture_buckets([4, 2, 1], one)
        == "capturing the decode graph of batch size 2 failed: RuntimeError: capture-unsafe op"
    )
    assert done == [4]
    assert capture_buckets([4, 2, 1], lambda bs: None) is None
