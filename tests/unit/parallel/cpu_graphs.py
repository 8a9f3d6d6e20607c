"""CUDA graphs stood in on a CPU rank, for the tests of captured steps at --tp-size > 1: the ranks
are real processes over gloo, the device is not a GPU. `install(set_attr, fail, log)` patches, in
this process (rank 0 with pytest's monkeypatch.setattr, another rank with setattr):

- the runner says graphs are supported (as on CUDA with the Triton backend), so rank 0 captures
  at start-up and sends OP_CAPTURE, and the other ranks capture on it, agreeing after each bucket;
- a bucket's "capture" runs the two warm-ups and the forward a capture records (their
  all-reduces in the order every rank runs them) and keeps that forward's output as the graph's
  static output; its replay runs the forward again on the static buffers into that output: what a
  CUDA graph replay computes, here eagerly, with the all-reduces the graph holds;
- fail=(set name, bucket): that bucket's capture raises on this rank after its forwards (as a
  graph that fails to instantiate, out of memory, would: a real capture records the collectives
  without running them, so no other rank waits on this one);
- log: a file each capture and replay appends one line to, "capture <set> <bs>" / "replay <set> <bs>".
"""

from __future__ import annotations

from typing import Callable, Optional

from dsv4_engine.cuda_graphs import DecodeGraphs, alone
from dsv4_engine.model_runner import ModelRunner

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (injected on this rank)"


def read_log(path) -> list[str]:
    try:
        with open(path) as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


def install(set_attr: Callable, fail: Optional[tuple[str, int]] = None, log: Optional[str] = None) -> None:
    def note(line: str) -> None:
        if log is not None:
            with open(log, "a") as f:
                f.write(line + "\n")

    class CPUGraph:
        """A captured bucket: its replay recomputes the static output from the static inputs."""

        def __init__(self, graphs: DecodeGraphs, bs: int):
            self.graphs, self.bs = graphs, bs

        def replay(self) -> None:
            g = self.graphs
            g.outputs[self.bs].copy_(g.run_forward(g.inputs.view(self.bs), self.bs))
            note(f"replay {g.name} {self.bs}")

    def capture_one(self: DecodeGraphs, bs: int) -> None:
        for _ in range(2):
            self.run_forward(self.inputs.view(bs), bs)
        out = self.run_forward(self.inputs.view(bs), bs).clone()
        if fail == (self.name, bs):
            raise RuntimeError(OOM)
        self.outputs[bs] = out
        self.graphs[bs] = CPUGraph(self, bs)
        note(f"capture {self.name} {bs}")

    real_capture_all = DecodeGraphs.capture_all

    def capture_all(self: DecodeGraphs, agree=alone):
        self.capture = True  # what a CUDA device gets
        return real_capture_all(self, agree)

    set_attr(ModelRunner, "graphs_supported", lambda self: True)
    set_attr(DecodeGraphs, "_capture_one", capture_one)
    set_attr(DecodeGraphs, "_synchronize", lambda self: None)
    set_attr(DecodeGraphs, "capture_all", capture_all)
