"""The v4-tiny-long preset (issue 41's agent workload needs more than v4-tiny's 1,024 positions):
v4-tiny's shapes with a 16,384-token context, and an engine built on it takes a prompt past 1,024."""

from __future__ import annotations

import json

from safetensors import safe_open

from dsv4_engine.checkpoint import PRESETS


def _shapes(folder) -> dict:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def test_long_preset_is_v4_tiny_with_a_longer_context(make_model):
    short, long = PRESETS["v4-tiny"], PRESETS["v4-tiny-long"]
    assert {k: v for k, v in long.items() if k != "max_position_embeddings"} == {
        k: v for k, v in short.items() if k != "max_position_embeddings"
    }
    assert short["max_position_embeddings"] == 1024 and long["max_position_embeddings"] == 16384
    a, b = make_model("v4-tiny"), make_model("v4-tiny-long")
    assert _shapes(a) == _shapes(b)
    assert json.loads((b / "config.json").read_text())["max_position_embeddings"] == 16384


def test_an_engine_on_the_long_preset_serves_past_1024_positions(make_model, one_torch_thread):
    from dsv4_engine.engine import Engine
    from dsv4_engine.engine_args import EngineArgs
    from dsv4_engine.sampling_params import SamplingParams
    from dsv4_engine.sequence import Sequence

    eng = Engine(EngineArgs(model=str(make_model("v4-tiny-long")), device="cpu", kernel_backend="cpu", kv_pages=90))
    assert eng.max_model_len == 90 * 16  # the pool, not the model, is the limit now
    outs = []
    eng.submit(
        Sequence(
            rid="long",
            prompt_ids=[5 + i % 200 for i in range(1100)],
            params=SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
            sink=outs.append,
        )
    )
    while not any(o.finished for o in outs):
        eng.step()
    end = [o for o in outs if o.finished][0]
    assert end.error is None and end.completion_tokens == 2
