"""Every thread that launches work asks for the engine's device first: CUDA's current device is
per thread and starts at 0, and Triton launches on it whatever device the tensors are on.
Checked on CPU by recording the device each launch site asks for."""

from __future__ import annotations

import threading

import torch

from dsv4_engine import devices
from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence


def test_use_device_sets_the_threads_cuda_device_and_resolves_a_bare_cuda(monkeypatch):
    asked: list[torch.device] = []
    monkeypatch.setattr(devices.torch.cuda, "set_device", asked.append)
    monkeypatch.setattr(devices.torch.cuda, "current_device", lambda: 3)
    devices.use_device(torch.device("cuda", 1))
    devices.use_device(torch.device("cuda"))  # the building thread's device, fixed to its index
    devices.use_device(torch.device("cpu"))  # nothing to choose
    assert asked == [torch.device("cuda", 1), torch.device("cuda", 3)]
    assert devices.resolve(torch.device("cuda")) == torch.device("cuda", 3)
    assert devices.resolve(torch.device("cpu")) == torch.device("cpu")


def test_the_engine_thread_asks_for_the_engines_device_before_any_step(tiny_model, monkeypatch):
    """The loop thread (not the thread that built the engine) runs the steps; each thread that
    ran a step had asked for the runner's device before its first one."""
    import dsv4_engine.engine as engine_mod

    engine = Engine(EngineArgs(model=str(tiny_model), device="cpu", kernel_backend="cpu", kv_pages=32, page_size=8))
    asked: dict[str, list[torch.device]] = {}
    stepped: dict[str, int] = {}
    monkeypatch.setattr(
        engine_mod, "use_device", lambda d: asked.setdefault(threading.current_thread().name, []).append(d)
    )
    step = engine.runner.step

    def recording_step(*a, **kw):
        name = threading.current_thread().name
        assert asked.get(name), f"thread {name} launched a step before choosing its device"
        stepped[name] = stepped.get(name, 0) + 1
        return step(*a, **kw)

    engine.runner.step = recording_step
    done = threading.Event()
    engine.submit(
        Sequence(
            "a",
            [5, 6, 7],
            SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
            sink=lambda out: out.finished and done.set(),
        )
    )
    engine.start()
    try:
        assert done.wait(30)
    finally:
        engine.stop()
    assert set(stepped) == {"dsv4-engine"} and stepped["dsv4-engine"] >= 3
    assert asked["dsv4-engine"] == [engine.runner.device]


def test_bfloat16_is_the_default_on_cuda_and_float32_on_cpu(tiny_model):
    from dsv4_engine.engine_args import EngineArgs as Args
    from dsv4_engine.model_runner import ModelRunner, default_dtype

    assert default_dtype(torch.device("cuda", 1)) == "bfloat16"
    assert default_dtype(torch.device("cpu")) == "float32"
    assert Args(model="m").dtype is None  # chosen by the core, which knows the device
    assert ModelRunner(tiny_model, device="cpu", kernel_backend="cpu").dtype == torch.float32
    assert ModelRunner(tiny_model, "bfloat16", device="cpu", kernel_backend="cpu").dtype == torch.bfloat16
