"""The batched sampler: the distribution it draws from, top-k and top-p, seeds, and one read
of the device per batch (a per-row sampler read it three times a row)."""

from __future__ import annotations

import torch
from host_sync_probe import count_host_syncs

from dsv4_engine.sampling import Sampled, sample
from dsv4_engine.sampling_params import SamplingParams


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    logits = probs.log().repeat(4000, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(4000)]
    out = sample(logits, [SamplingParams(temperature=1.0)] * 4000, gens)
    counts = torch.bincount(torch.tensor([o.token for o in out]), minlength=4).float() / 4000
    assert torch.allclose(counts, probs, atol=0.03), counts


def test_top_k_and_top_p_limit_the_choices():
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0, -1.0]]).repeat(300, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(300)]
    top_k = sample(logits, [SamplingParams(temperature=2.0, top_k=2)] * 300, gens)
    assert {o.token for o in top_k} == {0, 1}
    top_p = sample(logits, [SamplingParams(temperature=1.0, top_p=0.5)] * 300, gens)
    assert {o.token for o in top_p} <= {0, 1} and len({o.token for o in top_p}) == 2
    tiny_p = sample(logits, [SamplingParams(temperature=1.0, top_p=0.01)] * 50, gens[:50])
    assert {o.token for o in tiny_p} == {0}


def test_a_seed_gives_the_same_tokens_whatever_the_batch_around_it():
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    alone = sample(logits[2:3], [SamplingParams(temperature=0.9, top_k=20, seed=5)], [torch.Generator().manual_seed(5)])
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=20, seed=5),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(temperature=1.5),
    ]
    gens = [
        None,
        torch.Generator().manual_seed(1),
        torch.Generator().manual_seed(5),
        None,
        None,
        torch.Generator().manual_seed(3),
    ]
    out = sample(logits, params, gens)
    assert out[2].token == alone[0].token
    assert out[0].token == int(logits[0].argmax()) and out[4].token == int(logits[4].argmax())
    assert all(isinstance(o, Sampled) for o in out)


def test_one_host_read_per_batch():
    logits = torch.randn(16, 64)
    params = [
        SamplingParams(temperature=0.7, top_k=8, top_p=0.9) if i % 2 else SamplingParams(temperature=0)
        for i in range(16)
    ]
    gens = [torch.Generator().manual_seed(i) for i in range(16)]
    with count_host_syncs() as hits:
        out = sample(logits, params, gens)
    assert all(isinstance(o, Sampled) for o in out)
    assert len(hits) == 1, "\n".join(hits)
