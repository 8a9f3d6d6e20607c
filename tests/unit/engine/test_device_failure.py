"""A dead device fails the engine, not only the batch (dsv4_engine.device_errors): /health
fails, every request ends with the reason, and the serving process exits so that its requests
migrate. Out of memory stays the batch's own failure."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from dsv4_engine.device_errors import device_failure
from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence

ILLEGAL = "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be reported later"


def test_which_errors_mean_the_device_is_gone():
    assert device_failure(torch.AcceleratorError(ILLEGAL)) == (
        "AcceleratorError: CUDA error: an illegal memory access was encountered"
    )
    assert device_failure(RuntimeError("CUDA error: device-side assert triggered")) is not None
    assert device_failure(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp, unhandled cuda error")) is not None
    assert device_failure(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")) is None
    assert device_failure(ValueError("a seed the generator refuses")) is None
    assert device_failure(RuntimeError("shape mismatch")) is None


def _engine(model) -> Engine:
    return Engine(EngineArgs(model=str(model), device="cpu", kernel_backend="cpu", kv_pages=32, page_size=8))


def _submit(e: Engine, rid: str, outs: list) -> Sequence:
    seq = Sequence(rid, [5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), sink=outs.append)
    e.submit(seq)
    return seq


def test_a_device_error_in_a_step_fails_the_engine_and_every_request(tiny_model, monkeypatch):
    e = _engine(tiny_model)
    e._thread = type("T", (), {"is_alive": lambda self: True})()  # as if started: `alive` reads it
    outs: list = []
    _submit(e, "a", outs)
    e.step()  # the prefill, fine
    assert e.alive
    _submit(e, "b", outs)  # waits while "a" decodes

    def dead(*a, **k):
        raise torch.AcceleratorError(ILLEGAL)

    monkeypatch.setattr(e.runner, "forward", dead)
    e.step()
    assert not e.alive and e.failed == (
        "device failed: AcceleratorError: CUDA error: an illegal memory access was encountered"
    )
    finals = {o.rid: o for o in outs if o.finished}
    assert set(finals) == {"a", "b"} and not e.seqs  # the batch's request and the waiting one
    assert all("illegal memory access" in (o.error or "") and o.error_code == 500 for o in finals.values())
    assert e._stop.is_set()  # the loop ends


def test_out_of_memory_fails_the_batch_only(tiny_model, monkeypatch):
    e = _engine(tiny_model)
    outs: list = []
    _submit(e, "a", outs)

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(e.runner, "forward", oom)
    e.step()
    assert e.failed is None and not e._stop.is_set()
    assert outs[-1].finished and "out of memory" in outs[-1].error


def test_the_serving_process_exits_on_a_dead_device(tiny_model):
    """With exit_on_device_failure (what the serving core sets) the process itself goes, exit
    status 1, after the failed requests' outputs left: a real process, run to its end."""
    script = textwrap.dedent(
        f"""
        import torch, time
        from dsv4_engine.engine import Engine
        from dsv4_engine.engine_args import EngineArgs
        from dsv4_engine.sampling_params import SamplingParams
        from dsv4_engine.sequence import Sequence
        e = Engine(EngineArgs(model={str(tiny_model)!r}, device="cpu", kernel_backend="cpu", kv_pages=32, page_size=8))
        e.exit_on_device_failure = True
        def dead(*a, **k):
            raise torch.AcceleratorError("CUDA error: unspecified launch failure")
        e.runner.forward = dead
        outs = []
        e.start()
        e.submit(Sequence("a", [5, 6], SamplingParams(max_tokens=2), sink=outs.append))
        time.sleep(30)
        print("still alive", flush=True)
        """
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "still alive" not in p.stdout
    assert "device failed: AcceleratorError: CUDA error: unspecified launch failure" in p.stderr
