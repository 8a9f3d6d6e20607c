"""Which drafted tokens a step keeps.

Greedy: the drafts that equal the target's own argmax at their position, up to the first that
does not, then the target's token at the first mismatch (or after the last draft): exactly what
decoding one token at a time would produce.

Sampled (temperature > 0): rejection sampling (Leviathan et al. 2023; Chen et al. 2023). Draft j
was drawn from the drafter's distribution q_j; it is kept with probability min(1, p_j(d)/q_j(d)),
where p_j is the target's distribution at that position. At the first rejection the token comes
from the normalised residual max(0, p_j - q_j); when every draft is kept, one more token comes
from the target's distribution after the last draft. Each emitted token is then distributed
exactly as the target's p at its position.
"""

from __future__ import annotations

from typing import Optional

import torch


def accept_greedy(drafts: list[int], target: list[int]) -> list[int]:
    """The tokens to emit: target holds the target's argmax at each of len(drafts) + 1 positions."""
    assert len(target) == len(drafts) + 1
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return target[: n + 1]


def rejection_sample(
    p: torch.Tensor, q: torch.Tensor, drafts: list[int], generator: Optional[torch.Generator]
) -> list[int]:
    """The tokens to emit from target probabilities p [k+1, V], draft probabilities q [k, V]
    (float, rows summing to 1) and the k drafted ids (each drawn from its row of q)."""
    k = len(drafts)
    assert p.shape[0] == k + 1 and q.shape[0] == k
    dev = p.device
    out: list[int] = []
    if k:
        u = torch.rand(k, generator=generator, device=dev, dtype=torch.float64)
        d = torch.tensor(drafts, device=dev)
        rows = torch.arange(k, device=dev)
        pd, qd = p[rows, d].double(), q[rows, d].double()
        keep = (u * qd <= pd).tolist()  # u < p/q without dividing by a q of 0
        for j in range(k):
            if not keep[j]:
                residual = (p[j].double() - q[j].double()).clamp_min_(0)
                if residual.sum() <= 0:  # p == q up to rounding: nothing left over, p itself
                    residual = p[j].double()
                out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
                return out
            out.append(drafts[j])
    out.append(int(torch.multinomial(p[k].double(), 1, generator=generator)))
    return out


def sampling_probs(
    logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float]
) -> torch.Tensor:
    """Rows of fp32 logits [B, V] -> the distributions a request samples from: temperature, then
    top-k, then top-p (the smallest prefix of the sorted probabilities reaching top_p), as the
    engine's sampler does, renormalised."""
    x = logits.float() / torch.tensor(temperature, dtype=torch.float32, device=logits.device)[:, None]
    V = x.shape[1]
    for i, k in enumerate(top_k):
        if k and 0 < k < V:
            kth = torch.topk(x[i], k).values[-1]
            x[i] = x[i].masked_fill(x[i] < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if any(tp < 1.0 for tp in top_p):
        sp, order = torch.sort(probs, dim=-1, descending=True)
        cum = torch.cumsum(sp, dim=-1)
        tp = torch.tensor(top_p, dtype=torch.float32, device=logits.device)[:, None]
        sp = sp.masked_fill(cum - sp > tp, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sp)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
