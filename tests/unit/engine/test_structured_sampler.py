"""The grammar mask in the sampler: only the rows that ask are masked (the others sample what
they sample without it), the mask comes first as -inf so logit_bias, penalties, min_tokens,
temperature/top-k/top-p and logprobs all stay inside the grammar, min_tokens yields to a
grammar that can only end, and masking reads nothing back from the device."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from host_sync_probe import count_host_syncs

from dsv4_engine.sampling import LOGPROB_FLOOR, apply_token_mask, sample, unpack_bitmask
from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.structured.bitmask import StepMask, _pack

V, EOS = 70, 1


@dataclass(eq=False)
class History:
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)


def mask_of(allowed_rows: list[set[int]]) -> torch.Tensor:
    width = -(-V // 32)
    b = torch.zeros(len(allowed_rows), width * 32, dtype=torch.bool)
    for j, allowed in enumerate(allowed_rows):
        b[j, sorted(allowed)] = True
    return _pack(b)


def test_pack_and_unpack_are_inverse():
    torch.manual_seed(0)
    allowed = torch.rand(3, 96) < 0.3
    assert torch.equal(unpack_bitmask(_pack(allowed), V), allowed[:, :V])


def test_only_the_rows_that_ask_are_masked_and_the_others_are_unchanged():
    torch.manual_seed(1)
    logits = torch.randn(3, V)
    allowed = {5, 9, 33, 64}
    params = [SamplingParams(temperature=0.9, seed=s, logprobs=2) for s in (1, 2, 3)]
    gens = lambda: [torch.Generator().manual_seed(s) for s in (1, 2, 3)]  # noqa: E731
    free = sample(logits, params, gens())
    masked = sample(logits, params, gens(), mask=StepMask([1], mask_of([allowed])))
    assert masked[0] == free[0] and masked[2] == free[2]
    assert masked[1].token in allowed
    assert {t for t, _ in masked[1].logprob["top"]} <= allowed  # logprobs after the mask, as vLLM's
    out = apply_token_mask(logits, [1], mask_of([allowed]))
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.isinf(out[1]).sum() == V - len(allowed)


@pytest.mark.parametrize(
    "p",
    [
        SamplingParams(temperature=0, logit_bias={7: 100.0}),  # a bias cannot lift a forbidden token
        SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.5),
        SamplingParams(temperature=1.3, top_k=3, seed=5),
        SamplingParams(temperature=0.7, top_p=0.5, seed=6),
        SamplingParams(temperature=1.0, logprobs=5, seed=7),
    ],
)
def test_every_sampling_feature_stays_inside_the_grammar(p):
    torch.manual_seed(2)
    allowed = {2, 11, 40}
    for trial in range(8):
        logits = torch.randn(2, V) * 4
        gens = [torch.Generator().manual_seed(trial)] * 2
        hist = [History([3, 11], [11, 40]), History()]
        out = sample(
            logits, [p, SamplingParams(temperature=0)], gens, hist, [EOS], mask=StepMask([0], mask_of([allowed]))
        )
        assert out[0].token in allowed, (trial, out[0])
        assert out[1].token == int(logits[1].argmax())
        if p.logprobs:  # more alternatives asked than allowed: the rest are reported at the floor
            assert {t for t, lp in out[0].logprob["top"] if lp > LOGPROB_FLOOR} == allowed


def test_greedy_under_a_mask_is_the_best_allowed_token():
    torch.manual_seed(3)
    logits = torch.randn(4, V)
    allowed = [{1, 2, 3}, {60, 61}, set(range(V)), {0}]
    out = sample(logits, [SamplingParams(temperature=0)] * 4, [None] * 4, mask=StepMask([0, 1, 2, 3], mask_of(allowed)))
    for j, a in enumerate(allowed):
        assert out[j].token == max(a, key=lambda t: float(logits[j, t]))


def test_min_tokens_yields_to_a_grammar_that_can_only_end():
    logits = torch.randn(1, V)
    p = SamplingParams(temperature=0, min_tokens=5)
    h = [History([4], [9])]
    only_eos = StepMask([0], mask_of([{EOS}]), may_end={0})
    assert sample(logits, [p], [None], h, [EOS], mask=only_eos)[0].token == EOS
    # Without may_end the two masks leave nothing: that row fails alone, with a reason.
    stuck = sample(logits, [p], [None], h, [EOS], mask=StepMask([0], mask_of([{EOS}])))
    assert isinstance(stuck[0], Exception) and "no token is allowed" in str(stuck[0])
    # While the grammar allows more than the end, min_tokens still holds EOS back.
    more = StepMask([0], mask_of([{EOS, 30}]))
    assert sample(logits, [p], [None], h, [EOS], mask=more)[0].token == 30


def test_a_rows_grammar_failure_fails_that_row_only():
    logits = torch.randn(2, V)
    m = StepMask([0, 1], mask_of([{3}, {4}]), errors={0: ValueError("token 9 is not allowed")})
    out = sample(logits, [SamplingParams(temperature=0)] * 2, [None] * 2, mask=m)
    assert isinstance(out[0], Exception) and "token 9" in str(out[0]) and out[1].token == 4


def test_masking_reads_nothing_back():
    logits = torch.randn(4, V)
    params = [
        SamplingParams(temperature=0.8, seed=1, logit_bias={3: 1.0}, min_tokens=2),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, presence_penalty=0.5),
        SamplingParams(temperature=1.0, top_p=0.9),
    ]
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    hist = [History([1], [2]) for _ in range(4)]
    m = StepMask([0, 2], mask_of([{3, 4, 5}, {6, 7}]))
    with count_host_syncs() as plain:
        sample(logits, params, gens, hist, [EOS])
    with count_host_syncs() as masked:
        sample(logits, params, gens, hist, [EOS], mask=m)
    assert len(masked) == len(plain), masked  # the one read of the results, nothing more
