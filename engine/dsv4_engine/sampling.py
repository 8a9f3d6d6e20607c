"""The sampler: greedy, temperature, top-k, top-p, per-request seeds, and log-probabilities for
the requests that ask for them. Its parameters (`SamplingParams`, re-exported here) live in the
torch-free `dsv4_engine.sampling_params`.

Every row is sampled on its own terms and fails on its own: one request whose row cannot be
sampled (non-finite logits, an impossible distribution) gets an exception in its slot of the
result, and every other row of the batch still gets its token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from dsv4_engine.sampling_params import MAX_LOGPROBS, SamplingParams  # noqa: F401  (their old home)

# What a logprob of -inf is reported as (JSON has no infinity; vLLM reports the same floor).
LOGPROB_FLOOR = -9999.0
# Temperatures between 0 and this are raised to it: dividing logits by a denormal turns them
# into infinities (vLLM clamps the same way).
MIN_TEMPERATURE = 1e-2


@dataclass
class Sampled:
    """One row's result: the token and, when the request asked, its logprob entry
    {"token_id", "logprob", "top": [[token_id, logprob], ...]}."""

    token: int
    logprob: Optional[dict] = None


class SamplingError(RuntimeError):
    """This row could not be sampled; only its request fails."""


def request_generator(seed: int, device: torch.device) -> torch.Generator:
    """A request's own random stream, on the device its logits live on: torch.multinomial
    refuses a generator of another device (a CPU generator with CUDA logits raises)."""
    return torch.Generator(device=device).manual_seed(seed)


def same_device(a: torch.device, b: torch.device) -> bool:
    """True when tensors on a and b can meet in one op ('cuda' and 'cuda:0' are one device
    when the current device is 0)."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type == "cuda" and (a.index is None or b.index is None):
        current = torch.cuda.current_device()
        return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
    return a.index == b.index


def _finite(x: float) -> float:
    return x if x == x and x != float("-inf") else LOGPROB_FLOOR


def logprob_entry(logprobs_row: torch.Tensor, token: int, n: int) -> dict:
    """The logprob of `token` and the n most likely tokens, from one row of log-softmax."""
    entry = {"token_id": token, "logprob": _finite(float(logprobs_row[token])), "top": []}
    if n > 0:
        vals, idx = torch.topk(logprobs_row, min(n, logprobs_row.numel()))
        entry["top"] = [[int(i), _finite(float(v))] for v, i in zip(vals.tolist(), idx.tolist())]
    return entry


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], rows: list[int],
                 generators: list[Optional[torch.Generator]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of `rows` of fp32 logits, all rows at once: temperature, top-k and
    top-p as tensors over the batch, then an exponential race (argmax of p / Exp(1), which picks
    i with probability p_i) whose noise each row draws from its own generator. Returns (tokens,
    invalid) as device tensors [len(rows)]; nothing here reads the device from the host."""
    dev = logits.device
    ps = [params[i] for i in rows]
    knobs = torch.tensor([[max(p.temperature, MIN_TEMPERATURE), p.top_k if p.top_k and p.top_k > 0 else 0, p.top_p]
                          for p in ps], dtype=torch.float32).to(dev, non_blocking=True)
    x = logits[torch.tensor(rows).to(dev, non_blocking=True)] / knobs[:, :1]
    vocab = x.shape[1]
    k_max = max((p.top_k for p in ps if p.top_k and p.top_k > 0), default=0)
    if k_max:
        k = knobs[:, 1].long()
        top = torch.topk(x, min(k_max, vocab), dim=-1).values
        kth = top.gather(1, (k.clamp(1, top.shape[1]) - 1)[:, None])
        x = x.masked_fill((k[:, None] > 0) & (x < kth), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if any(p.top_p < 1.0 for p in ps):
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        sorted_p = sorted_p.masked_fill(cum - sorted_p > knobs[:, 2:], 0.0)  # keep the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    invalid = ~torch.isfinite(probs).all(dim=-1) | (probs.sum(dim=-1) <= 0)
    noise = torch.empty_like(probs)
    for j, i in enumerate(rows):
        noise[j].exponential_(generator=generators[i])
    return (probs / noise.clamp_min_(1e-30)).argmax(dim=-1), invalid


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[Optional[torch.Generator]]) -> list[Union[Sampled, Exception]]:
    """One result per row of fp32 logits [B, V]: a Sampled, or the exception that row raised.

    The whole batch is sampled with batched tensor ops and read back to the host once (a
    per-row sampler waits for the GPU several times a row). Logprobs are those of the model's
    raw distribution (log-softmax of the logits before temperature, top-k and top-p), the
    choice vLLM documents as its default."""
    logits = logits.float()
    out: list[Union[Sampled, Exception, None]] = [None] * len(params)
    for i, (p, gen) in enumerate(zip(params, generators)):
        if gen is not None and not p.greedy and not same_device(gen.device, logits.device):
            out[i] = SamplingError(f"this request's generator is on {gen.device}, its logits on {logits.device}")
    rows = [i for i, p in enumerate(params) if not p.greedy and out[i] is None]
    parts = [logits.argmax(dim=-1), torch.isnan(logits).any(dim=-1).long()]
    if rows:
        tokens, invalid = _sample_rows(logits, params, rows, generators)
        parts += [tokens, invalid.long()]
    host = torch.cat(parts).tolist()  # the one read of the batch's results
    B = len(params)
    greedy, nan_rows = host[:B], host[B : 2 * B]
    drawn = dict(zip(rows, zip(host[2 * B : 2 * B + len(rows)], host[2 * B + len(rows) :])))
    for i, p in enumerate(params):
        if out[i] is not None:
            continue
        try:
            if nan_rows[i]:
                raise SamplingError("the model produced NaN logits for this request")
            if p.greedy:
                tok = greedy[i]
            else:
                tok, bad = drawn[i]
                if bad:
                    raise SamplingError("the sampling distribution is not finite (check temperature/top_p/top_k)")
            entry = None
            if p.logprobs is not None:
                entry = logprob_entry(torch.log_softmax(logits[i], dim=-1), tok, p.logprobs)
            out[i] = Sampled(tok, entry)
        except Exception as e:  # noqa: BLE001 — whatever one row raises fails that row alone
            out[i] = e
    return out  # type: ignore[return-value]
