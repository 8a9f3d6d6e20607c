"""A tensor-parallel rank with CUDA graphs stood in on the CPU (cpu_graphs.py), then the real
worker: rank 0 spawns it in place of `-m dsv4_engine.parallel.worker` (parallel.ranks.WORKER).

`python cpu_graph_rank.py LOG [SET:BUCKET]`: LOG gets a line per capture and replay; SET:BUCKET
(e.g. "speculative draft:2") fails that bucket's capture on this rank."""

from __future__ import annotations

import sys

from cpu_graphs import install

from dsv4_engine.parallel import worker

if __name__ == "__main__":
    fail = None
    if len(sys.argv) > 2:
        name, bs = sys.argv[2].rsplit(":", 1)
        fail = (name, int(bs))
    install(setattr, fail, sys.argv[1])
    worker.main()
