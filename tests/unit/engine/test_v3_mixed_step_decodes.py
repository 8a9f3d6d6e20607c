"""A V3 mixed step (decoding requests + a fresh prompt, CPU torch backend) hands its one-token
requests to the native decode kernel; greedy tokens match the mla_extend form."""

import pytest
import torch

from dsv4_kernels import cpu_mla


def _run(model_dir, native_mixed: bool, monkeypatch) -> tuple[list[list[int]], int]:
    from dsv4_engine.engine import Engine
    from dsv4_engine.engine_args import EngineArgs
    from dsv4_engine.layers import mla as V3
    from dsv4_engine.sampling_params import SamplingParams
    from dsv4_engine.sequence import Sequence

    monkeypatch.setattr(V3, "MIXED_DECODE_NATIVE", native_mixed)
    engine = Engine(EngineArgs(model=str(model_dir), device="cpu", kernel_backend="cpu", dtype="float32", kv_pages=64))
    assert engine.runner.local_model.ops.implementations()["mla_decode"] == "cpu: native"
    calls = []
    kernel = cpu_mla.mla_decode
    monkeypatch.setattr(cpu_mla, "mla_decode", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    g = torch.Generator().manual_seed(7)

    def seq(name: str, n: int) -> Sequence:
        ids = torch.randint(2, engine.cfg.vocab_size, (n,), generator=g).tolist()
        return Sequence(name, ids, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))

    running = [seq("a", 9), seq("b", 20), seq("c", 33)]
    for s in running:
        engine._add(s)
    while any(len(s.output_ids) < 2 for s in running):
        engine.step()
    fresh = seq("d", 24)
    engine._add(fresh)
    calls.clear()
    engine.step()  # the mixed step: three decodes and the fresh prompt's prefill
    assert fresh.output_ids and all(len(s.output_ids) == 3 for s in running)
    mixed_calls = list(calls)
    while engine.scheduler.has_work():
        engine.step()
    return [s.output_ids for s in running + [fresh]], mixed_calls


@pytest.mark.parametrize("preset", ["tiny", "mla512"])
def test_mixed_step_decodes_go_native_and_tokens_are_unchanged(preset, make_model, monkeypatch):
    model_dir = make_model(preset)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        on, on_calls = _run(model_dir, True, monkeypatch)
        off, off_calls = _run(model_dir, False, monkeypatch)
    finally:
        torch.set_num_threads(threads)
    assert on_calls and all(n == 3 for n in on_calls)  # each layer: the three decodes, one call
    assert off_calls == []  # before: mla_extend's per-request loop
    assert on == off
