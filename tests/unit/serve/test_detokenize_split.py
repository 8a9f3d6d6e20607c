"""Text and stop strings in the HTTP process (`OutputProcessor` over a core that sends ids only)
give the client exactly what the in-process engine gave: the same deltas, token ids, logprobs,
finish reasons and usage — for stop strings inside one token, across tokens, at the length limit,
for EOS and stop token ids. Driven step by step on the tiny model."""

from __future__ import annotations

import pytest

from dsv4_engine.engine import Engine
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence
from dsv4_serve.detokenize import OutputProcessor


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(EngineArgs(model=str(tiny_model), device="cpu", kernel_backend="cpu", kv_pages=128, page_size=8))


def client_view(engine: Engine, params: SamplingParams, detokenize: bool) -> list[tuple]:
    """What a client is shown, output by output, until the request ends."""
    engine.detokenize = detokenize
    proc = None if detokenize else OutputProcessor(engine.tokenizer, params)
    seq = Sequence("r", [5, 6, 7, 8], SamplingParams(**vars(params)))
    shown: list[tuple] = []

    def sink(out):
        if shown and shown[-1][3]:
            return  # ended here already (a stop string the core was told about)
        if proc is not None:
            out = proc.process(out)
        shown.append((out.token_ids, out.text, out.logprobs, out.finished, out.finish_reason, out.completion_tokens))
        if proc is not None and proc.stopped:
            engine.finish(seq, "stop")  # what the FINISH message makes the core do

    seq.sink = sink
    engine.submit(seq)
    try:
        for _ in range(200):
            engine.step()
            if seq.finished:
                break
    finally:
        engine.detokenize = True
    assert shown and shown[-1][3]
    assert not engine.seqs
    return shown


def test_ids_only_core_plus_output_processor_equals_the_in_process_engine(engine):
    base = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    text = "".join(o[1] for o in client_view(engine, base, True))
    assert len(text) > 12, text
    ids = [t for o in client_view(engine, base, True) for t in o[0]]
    cases = [
        base,
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[text[5:8]]),  # mid-text
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[text[-3:], "never seen"], logprobs=2),
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[text[:1]]),  # the very first characters
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[ids[6]], stop=["zzzz"]),
        SamplingParams(max_tokens=16, temperature=0.9, seed=3, stop=[text[2:4]], logprobs=1),  # EOS allowed, seeded
    ]
    for params in cases:
        assert client_view(engine, params, False) == client_view(engine, params, True), params
