"""DeepSeek-V4 edge cases the oracle and state-machine tests do not reach, on real v4-tiny
engines in this process (no HTTP; PD over the fake fabric): seeded sampling handed from prefill
to decode continues the random stream where mono would; decode preempts a handed-off request and
recomputes it exactly; a request waits on decode for a free slot row, then runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dsv4_engine.engine import Engine, limits_refusal
from dsv4_engine.engine_args import EngineArgs
from dsv4_engine.pd.request_info import PDRequestInfo
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.sequence import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pd"))  # the PD pair over the fake fabric
from test_state_machines import Client, Pair  # noqa: E402
from test_v4_state_machines import pair, v4_engines  # noqa: E402,F401  (fixtures: the v4-tiny trio and its pair)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def submit(engine: Engine, rid: str, prompt: list[int], params: SamplingParams, room=None) -> Client:
    client = Client()
    seq = Sequence(rid=rid, prompt_ids=list(prompt), params=params, sink=client.outputs.append)
    if room is not None:
        seq.pd = PDRequestInfo("127.0.0.1", 9100, room)
        seq.prefill_only = engine.args.role == "prefill"
    engine.submit(seq)
    return client


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.9, seed=7),
        dict(temperature=1.0, seed=11, top_p=0.8),
        dict(temperature=0.7, seed=3, top_k=5),
    ],
    ids=["temperature", "top_p", "top_k"],
)
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


@pytest.fixture(scope="module")
def tight_decode(make_model):
    """Prefill, a decode with 12 pages of 4 tokens and 2 slot rows, and mono: three requests
    that each grow to 29-35 tokens cannot all fit decode's pool, nor its rows."""
    model = make_model("v4-tiny")

    def make(role: str, pages: int, seqs: int) -> Engine:
        return Engine(
            EngineArgs(
                model=str(model),
                role=role,
                device="cpu",
                kernel_backend="cpu",
                kv_pages=pages,
                page_size=4,
                max_num_seqs=seqs,
                max_num_batched_tokens=64,
                served_model_name="m",
            )
        )

    return make("prefill", 40, 4), make("decode", 12, 2), make("mono", 200, 4)


def mono_tokens(mono: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    client = submit(mono, f"m-{len(prompt)}-{params.seed}-{params.temperature}", prompt, params)
    while not client.ends:
        mono.step()
    return client.tokens


def test_decode_preempts_a_handed_off_request_and_recomputes_it_exactly(tight_decode):
    """Decode's pool fills as its requests grow: it preempts one that came from prefill (its
    pages and slot row go back) and recomputes it from position 0 on decode, prompt and tokens
    so far, window ring and compressor stages included; the output stays mono's, greedy and
    seeded alike."""
    pair = Pair(tight_decode)
    preempted: list[str] = []
    sched = pair.d.scheduler
    real_preempt = sched._preempt
    sched._preempt = lambda seq: (preempted.append(seq.rid), real_preempt(seq))
    try:
        prompts = [[(7 * i + 3 * j) % 400 + 5 for j in range(n)] for i, n in enumerate([15, 13, 9])]
        params = [
            SamplingParams(max_tokens=20, ignore_eos=True, temperature=0),
            SamplingParams(max_tokens=20, ignore_eos=True, temperature=0),
            SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, seed=4),
        ]
        runs = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            pair.room += 1
            runs.append(
                (
                    submit(pair.p, f"p{i}", prompt, sp, room=pair.room),
                    submit(pair.d, f"d{i}", prompt, sp, room=pair.room),
                )
            )
        pair.run_until(lambda: all(dc.ends for _, dc in runs), limit=120)
        assert preempted, "decode's 12 pages should have forced a preemption"
        for (pc, dc), prompt, sp in zip(runs, prompts, params):
            assert pc.end.error is None and dc.end.error is None, dc.end.error
            assert dc.tokens == mono_tokens(tight_decode[2], prompt, sp)
        pair.assert_clean("p", "d")
    finally:
        sched._preempt = real_preempt
        pair.close()


def test_decode_without_a_free_slot_row_waits_then_takes_a_freed_one(tight_decode):
    """Four requests, two slot rows on decode: two wait in decode's prealloc queue holding
    nothing, register as rows free up, and end as mono's; nothing is left held."""
    pair = Pair(tight_decode)
    try:
        sp = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0)
        prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 42], [7], [90 + j for j in range(17)]]
        runs = []
        for i, prompt in enumerate(prompts):
            pair.room += 1
            runs.append(
                (
                    submit(pair.p, f"p{i}", prompt, sp, room=pair.room),
                    submit(pair.d, f"d{i}", prompt, sp, room=pair.room),
                )
            )
        pair.step(2, dt=0.01)
        loads = pair.d.loads()
        assert loads["kv_slots_free"] == 0 and loads["queues"]["prealloc"] >= 2
        pair.run_until(lambda: all(dc.ends for _, dc in runs))
        for (pc, dc), prompt in zip(runs, prompts):
            assert pc.end.error is None and dc.end.error is None, dc.end.error
            assert dc.tokens == mono_tokens(tight_decode[2], prompt, sp)
        pair.assert_clean("p", "d")
    finally:
        pair.close()


@pytest.mark.parametrize(
    "limits, flag",
    [(dict(max_num_batched_tokens=0), "--max-num-batched-tokens"), (dict(max_num_seqs=0), "--max-num-seqs")],
)
def test_limits_that_cannot_serve_are_refused_at_start(make_model, limits, flag):
    """A 0-token step budget admitted nothing (every request waited forever); 0 requests at once
    crashed V4's slot pool with an IndexError. Both are refused in one line before any weight loads."""
    assert limits_refusal(8, 1) is None
    with pytest.raises(ValueError, match=f"^{flag} must be at least 1, not 0$"):
        Engine(
            EngineArgs(
                model=str(make_model("v4-tiny")),
                device="cpu",
                kernel_backend="cpu",
                kv_pages=8,
                page_size=4,
                **limits,
            )
        )


def test_a_request_decode_preempted_resumes_before_new_hand_offs_take_its_row(tight_decode):
    """Decode preempts a request when its pool fills; new hand-offs must not take the slot row
    and pages it gave back while it waits to resume (they did: decode preallocates for new
    requests before it schedules, so under a steady stream the preempted request never got a
    row back and its client waited without end)."""
    pair = Pair(tight_decode)
    preempted: list = []
    sched = pair.d.scheduler
    real_preempt = sched._preempt
    sched._preempt = lambda seq: (preempted.append(seq), real_preempt(seq))
    try:
        long = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0)
        short = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
        firsts = []
        for i, n in enumerate([15, 13]):
            pair.room += 1
            prompt = [(7 * i + 3 * j) % 400 + 5 for j in range(n)]
            firsts.append(
                (
                    prompt,
                    submit(pair.p, f"p{i}", prompt, long, room=pair.room),
                    submit(pair.d, f"d{i}", prompt, long, room=pair.room),
                )
            )
        pair.run_until(lambda: preempted, dt=0.01)
        victim = preempted[0]
        # A steady stream of short requests while the victim waits to resume.
        stream, taken_while_waiting = [], []
        for k in range(30):
            if k % 2 == 0 and len(stream) < 12:
                pair.room += 1
                prompt = [11 + k, 12, 13]
                stream.append(
                    (
                        prompt,
                        pair.room,
                        submit(pair.p, f"pc{k}", prompt, short, room=pair.room),
                        submit(pair.d, f"dc{k}", prompt, short, room=pair.room),
                    )
                )
            waiting = victim in sched.waiting
            before = set(pair.d.pd.registering) | set(pair.d.pd.transfer)
            pair.step(1, dt=0.01)
            got = (set(pair.d.pd.registering) | set(pair.d.pd.transfer)) - before
            if waiting and got:
                taken_while_waiting.append(sorted(got))
        pair.run_until(lambda: all(dc.ends for *_, dc in firsts) and all(dc.ends for *_, dc in stream), dt=0.05)
        assert not taken_while_waiting, (
            f"new hand-offs took rows/pages while a preempted request waited: {taken_while_waiting}"
        )
        for prompt, _, dc in firsts:
            assert dc.end.error is None and dc.tokens == mono_tokens(tight_decode[2], prompt, long)
        for prompt, _, _, dc in stream:  # they waited their turn, within their deadlines
            assert dc.end.error is None and dc.tokens == mono_tokens(tight_decode[2], prompt, short)
        pair.assert_clean("p", "d")
    finally:
        sched._preempt = real_preempt
        pair.close()
