"""DeepSeek-V4 edge cases the oracle and state-machine tests do not reach, on real v4-tiny
engines in this process (no HTTP): seeded sampling handed from prefill to decode continues the
random stream where mono would."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dsv4_engine.engine import Engine, EngineArgs
from dsv4_engine.pd.common import PDRequestInfo
from dsv4_engine.sampling import SamplingParams
from dsv4_engine.sequence import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pd"))  # the PD pair over the fake fabric
from test_state_machines import Client, Pair  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def v4_engines(make_model):
    model = make_model("v4-tiny")

    def make(role: str) -> Engine:
        return Engine(EngineArgs(model=str(model), role=role, device="cpu", kernel_backend="torch", kv_pages=40,
                                 page_size=8, max_num_seqs=4, max_num_batched_tokens=64, served_model_name="m"))

    return make("prefill"), make("decode"), make("mono")


@pytest.fixture
def pair(v4_engines):
    p = Pair(v4_engines)
    yield p
    p.close()


def submit(engine: Engine, rid: str, prompt: list[int], params: SamplingParams, room=None) -> Client:
    client = Client()
    seq = Sequence(rid=rid, prompt_ids=list(prompt), params=params, sink=client.outputs.append)
    if room is not None:
        seq.pd = PDRequestInfo("127.0.0.1", 9100, room)
        seq.prefill_only = engine.args.role == "prefill"
    engine.submit(seq)
    return client


@pytest.mark.parametrize("params", [
    dict(temperature=0.9, seed=7),
    dict(temperature=1.0, seed=11, top_p=0.8),
    dict(temperature=0.7, seed=3, top_k=5),
], ids=["temperature", "top_p", "top_k"])
def test_seeded_sampling_through_pd_equals_mono(pair, v4_engines, params):
    """Prefill samples the first token from the request's seeded stream; decode must go on from
    the second draw of that stream, not start it again (which repeats the first token's noise)."""
    prompt = [5, 17, 88, 130, 41, 9, 250, 77, 3, 61, 12]  # past the window (8) and a CSA window (4)
    sp = SamplingParams(max_tokens=10, ignore_eos=True, **params)
    pair.room += 1
    pc = submit(pair.p, f"p-{pair.room}", prompt, sp, room=pair.room)
    dc = submit(pair.d, f"d-{pair.room}", prompt, sp, room=pair.room)
    pair.run_until(lambda: dc.ends)
    assert pc.end.error is None and dc.end.error is None, dc.end.error
    mono = v4_engines[2]
    mc = submit(mono, f"m-{pair.room}", prompt, sp)
    while not mc.ends:
        mono.step()
    assert len(set(mc.tokens)) > 3  # really sampled, not a greedy run
    assert dc.tokens == mc.tokens
    pair.assert_clean("p", "d")
