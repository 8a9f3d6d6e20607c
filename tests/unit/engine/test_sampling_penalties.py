"""Logit processing in the sampler: logit_bias, presence/frequency/repetition penalties and
min_tokens, each against a naive per-request reference; a batch mixing requests with and
without them gives each what it gets alone; no extra op when nobody uses them; no host read."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from host_sync_probe import count_host_syncs

from dsv4_engine import sampling
from dsv4_engine.sampling import Sampled, process_logits, sample
from dsv4_engine.sampling_params import SamplingParams

V = 50
EOS = 1


@dataclass(eq=False)
class History:
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)


def reference(logits: torch.Tensor, p: SamplingParams, h: History, eos_ids=(EOS,)) -> torch.Tensor:
    """One row, one token at a time, the way the semantics are written down."""
    x = logits.clone().float()
    seen = set(h.prompt_ids) | set(h.output_ids)
    for t in range(x.numel()):
        if p.repetition_penalty != 1 and t in seen:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        n = h.output_ids.count(t)
        x[t] -= p.frequency_penalty * n + p.presence_penalty * (n > 0)
        x[t] += p.logit_bias.get(t, 0.0)
    if len(h.output_ids) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids)):
            x[t] = float("-inf")
    return x


def _greedy(logits, params, hists):
    return [o.token for o in sample(logits, params, [None] * len(params), hists, [EOS])]


def test_logit_bias_forces_a_greedy_token_and_leaves_logprobs_raw():
    torch.manual_seed(0)
    logits = torch.randn(2, V)
    forced = 7 if int(logits[0].argmax()) != 7 else 8
    out = sample(
        logits,
        [SamplingParams(temperature=0, logit_bias={forced: 100.0}, logprobs=1), SamplingParams(temperature=0)],
        [None, None],
        [History(), History()],
    )
    assert out[0].token == forced and out[1].token == int(logits[1].argmax())
    raw = torch.log_softmax(logits[0], -1)
    assert out[0].logprob["logprob"] == pytest.approx(float(raw[forced]), abs=1e-5)  # vLLM's default: raw
    assert out[0].logprob["top"][0][0] == int(logits[0].argmax())
    banned = sample(logits[:1], [SamplingParams(temperature=0, logit_bias={int(logits[0].argmax()): -100.0})], [None])
    assert banned[0].token != int(logits[0].argmax())


@pytest.mark.parametrize(
    "p",
    [
        SamplingParams(presence_penalty=1.5),
        SamplingParams(frequency_penalty=0.7),
        SamplingParams(presence_penalty=-0.5, frequency_penalty=1.2),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=0.3, logit_bias={3: 2.5, 9: -4.0}),
        SamplingParams(min_tokens=4, stop_token_ids=[5, 6], max_tokens=8),
        SamplingParams(min_tokens=4, stop_token_ids=[5], ignore_eos=True, max_tokens=8),
    ],
)
def test_processing_equals_the_naive_reference(p):
    torch.manual_seed(1)
    logits = torch.randn(1, V) * 3
    h = History(prompt_ids=[2, 3, 4, 3], output_ids=[9, 9, 4, 11, 9])
    got = process_logits(logits, [p], [h], [EOS])[0]
    assert torch.allclose(got, reference(logits[0], p, h), atol=1e-5), (got, reference(logits[0], p, h))


def test_counts_stay_right_as_the_output_grows_step_by_step():
    torch.manual_seed(2)
    p = SamplingParams(temperature=0, presence_penalty=0.4, frequency_penalty=0.9, repetition_penalty=1.1)
    h = History(prompt_ids=[1, 2, 3])
    base = torch.randn(V) * 2
    for step in range(12):
        logits = (base + 0.01 * step)[None]
        got = process_logits(logits, [p], [h], [EOS])[0]
        assert torch.allclose(got, reference(logits[0], p, h), atol=1e-5), step
        h.output_ids.append(int(got.argmax()))


def test_penalties_make_greedy_decoding_repeat_less():
    """A toy model whose logits favour the last token strongly and token 20 mildly: plain greedy
    repeats one token forever; a presence penalty breaks the loop; a frequency penalty lets the
    favourite come back only as often as its lead allows."""

    def run(p, steps=12):
        h = History(prompt_ids=[20])
        for _ in range(steps):
            logits = torch.zeros(1, V)
            logits[0, 20] = 1.0
            logits[0, (h.output_ids or h.prompt_ids)[-1]] += 1.0
            h.output_ids += _greedy(logits, [p], [h])
        return h.output_ids

    assert set(run(SamplingParams(temperature=0))) == {20}
    assert len(set(run(SamplingParams(temperature=0, presence_penalty=2.0)))) > 5
    freq = run(SamplingParams(temperature=0, frequency_penalty=0.5))
    assert 1 < freq.count(20) < 12
    # a negative penalty encourages repeating: the favourite keeps winning
    assert set(run(SamplingParams(temperature=0, presence_penalty=-2.0))) == {20}


def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    logits = torch.full((1, V), -5.0)
    logits[0, EOS] = 10.0
    logits[0, 5] = 9.0
    logits[0, 12] = 1.0
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5], max_tokens=8)
    h = History(prompt_ids=[2])
    toks = []
    for _ in range(4):
        toks += _greedy(logits, [p], [h])
        h.output_ids = list(toks)
    assert toks == [12, 12, 12, EOS]
    # ignore_eos: EOS is not a stop, so min_tokens leaves it alone (stop ids still held back)
    ign = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5], ignore_eos=True, max_tokens=8)
    assert _greedy(logits, [ign], [History()]) == [EOS]


def test_a_mixed_batch_gives_each_request_what_it_gets_alone():
    torch.manual_seed(3)
    logits = torch.randn(6, V) * 2
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, frequency_penalty=1.0, logit_bias={4: 3.0}),
        SamplingParams(temperature=0.8, seed=7),
        SamplingParams(temperature=0.8, seed=9, presence_penalty=2.0, repetition_penalty=1.2, logprobs=2),
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[int(logits[4].argmax())], max_tokens=4),
        SamplingParams(temperature=1.2, top_k=5, seed=11, logit_bias={int(logits[5].argmin()): 100.0}),
    ]
    hists = [History([1, 2], [int(logits[i].argmax()), 3, 3]) for i in range(6)]
    hists[4].output_ids = [3]  # one token of its min_tokens=2 so far

    def gens():
        return [None if p.greedy else torch.Generator().manual_seed(p.seed) for p in params]

    g = gens()
    together = sample(logits, params, g, hists, [EOS])
    g = gens()
    alone = [sample(logits[i : i + 1], [params[i]], [g[i]], [hists[i]], [EOS])[0] for i in range(6)]
    assert all(isinstance(o, Sampled) for o in together)
    assert [o.token for o in together] == [o.token for o in alone]
    assert together[3].logprob == alone[3].logprob
    assert together[0].token == int(logits[0].argmax())
    assert together[4].token != int(logits[4].argmax())
    assert together[5].token == int(logits[5].argmin())


def test_no_processing_adds_no_op_and_processing_reads_nothing_back(monkeypatch):
    logits = torch.randn(8, V)
    plain = [SamplingParams(temperature=0.7, seed=i) for i in range(8)]
    assert process_logits(logits, plain, None) is logits  # the fast path: not even a copy
    calls = []
    monkeypatch.setattr(sampling, "_counts_of", lambda *a: calls.append(a))
    sample(logits, plain, [torch.Generator().manual_seed(i) for i in range(8)])
    assert calls == []
    monkeypatch.undo()

    params = [
        SamplingParams(
            temperature=0.7,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            repetition_penalty=1.1,
            logit_bias={3: 1.0},
            min_tokens=5,
            stop_token_ids=[4],
            max_tokens=9,
        )
        if i % 2
        else SamplingParams(temperature=0)
        for i in range(8)
    ]
    hists = [History([1, 2, 3], [5, 6, 5]) for _ in range(8)]
    with count_host_syncs() as hits:
        process_logits(logits, params, hists, [EOS])
    assert hits == [], "\n".join(hits)
    with count_host_syncs() as hits:
        out = sample(logits, params, [torch.Generator().manual_seed(i) for i in range(8)], hists, [EOS])
    assert all(isinstance(o, Sampled) for o in out)
    assert len(hits) == 1, "\n".join(hits)  # the one read of the batch's results, as without processing


def test_an_id_past_the_vocab_never_reaches_the_device():
    logits = torch.randn(1, V)
    p = SamplingParams(temperature=0, logit_bias={V + 5: 100.0}, min_tokens=2, stop_token_ids=[V + 1], max_tokens=4)
    assert _greedy(logits, [p], [History()]) == [int(logits[0].argmax())]


def test_the_new_fields_cross_to_the_engine_core_process():
    from dsv4_serve import core_messages as cm

    p = SamplingParams(
        max_tokens=9,
        presence_penalty=0.5,
        frequency_penalty=-1.0,
        repetition_penalty=1.2,
        logit_bias={7: -100.0, 3: 2.5},
        min_tokens=4,
    )
    msg = cm.loads(cm.dumps(cm.add_msg(1, "r", [1, 2], p, None, False, 0.0)))
    assert cm.params_of(msg.params) == p
