"""The sampler: grammar masks (structured outputs), logit processing (presence/frequency/repetition
penalties, logit_bias, min_tokens), greedy, temperature, top-k, top-p, per-request seeds, and log-probabilities for the
requests that ask for them. Its parameters (`SamplingParams`, re-exported here) live in the
torch-free `dsv4_engine.sampling_params`.

Every row is sampled on its own terms and fails on its own: one request whose row cannot be
sampled (non-finite logits, an impossible distribution) gets an exception in its slot of the
result, and every other row of the batch still gets its token.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol, Sequence, Union

import torch

from dsv4_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dsv4_engine.structured.bitmask import StepMask

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

    status = 500


class NoTokenAllowed(SamplingError):
    """The request's own constraints (grammar, stop ids held back by min_tokens, logit_bias)
    leave no token: the client's error, a 400 that the router never moves to another engine
    (issue 39: a 500 was retried on up to three more engines, each re-prefilling)."""

    status = 400

    def __init__(self) -> None:
        super().__init__("no token is allowed here (the grammar and min_tokens/logit_bias leave none)")


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


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, W] int32 bit words -> [R, vocab] bool (bit k of word w: token 32*w + k allowed), on
    the words' device."""
    shifts = _SHIFTS.get(bits.device)
    if shifts is None:
        shifts = _SHIFTS[bits.device] = torch.arange(32, dtype=torch.int32, device=bits.device)
    return ((bits.unsqueeze(-1) >> shifts) & 1).view(bits.shape[0], -1)[:, :vocab].bool()


def apply_token_mask(logits: torch.Tensor, rows: list[int], bits: torch.Tensor) -> torch.Tensor:
    """`logits` [B, V] with -inf on every token row rows[j]'s mask bits[j] forbids: a new
    tensor, the other rows copied unchanged. Everything stays on the device (no host read)."""
    vocab = logits.shape[1]
    if len(rows) == logits.shape[0]:
        return logits.masked_fill(~unpack_bitmask(bits, vocab), float("-inf"))
    idx = torch.tensor(rows).to(logits.device, non_blocking=True)
    x = logits[idx].masked_fill_(~unpack_bitmask(bits, vocab), float("-inf"))
    return logits.index_copy(0, idx, x)


class TokenHistory(Protocol):
    """What the penalties read of a request: its prompt and the tokens generated so far (a
    `dsv4_engine.sequence.Sequence` is one). `output_ids` only grows while the request lives."""

    prompt_ids: list[int]
    output_ids: list[int]


class _Counts:
    """One request's token counts on the device, brought up to date with only the tokens
    generated since the last step (one id a decode step) instead of its whole output."""

    def __init__(self, vocab: int, device: torch.device):
        self.output = torch.zeros(vocab, dtype=torch.int32, device=device)  # times each token was generated
        self.seen: Optional[torch.Tensor] = None  # prompt or output contains the token (repetition_penalty)
        self.counted = 0  # output_ids[:counted] are in `output`

    def update(self, h: TokenHistory, want_seen: bool) -> None:
        if len(h.output_ids) < self.counted:  # not expected (output only grows): start over
            self.output.zero_()
            self.counted, self.seen = 0, None
        dev = self.output.device
        if want_seen and self.seen is None:
            self.seen = torch.zeros_like(self.output, dtype=torch.bool)
            if h.prompt_ids:
                self.seen.index_fill_(0, torch.tensor(h.prompt_ids).to(dev, non_blocking=True), True)
        new = h.output_ids[self.counted :]
        if new:
            ids = torch.tensor(new).to(dev, non_blocking=True)
            self.output.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
            if self.seen is not None:
                self.seen.index_fill_(0, ids, True)
            self.counted = len(h.output_ids)


# Per request (held weakly: a finished request's counts go with it), per device.
_counts: "weakref.WeakKeyDictionary[object, _Counts]" = weakref.WeakKeyDictionary()


def _counts_of(h: TokenHistory, vocab: int, device: torch.device, want_seen: bool) -> _Counts:
    c = _counts.get(h)
    if c is None or c.output.numel() != vocab or not same_device(c.output.device, device):
        c = _Counts(vocab, device)
        _counts[h] = c
    c.update(h, want_seen)
    return c


def process_logits(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: Optional[Sequence[TokenHistory]],
    eos_ids: Sequence[int] = (),
    may_end: frozenset[int] = frozenset(),
    pending: Optional[Sequence[Sequence[int]]] = None,
) -> torch.Tensor:
    """The logits each request samples from, [B, V]: `logits` itself when no request processes
    them (no op at all), else a copy where the rows that do are processed together:
    repetition_penalty (vLLM: over prompt and output, positive logits divided, negative
    multiplied), then presence and frequency penalties (OpenAI: over the output), then
    logit_bias, then min_tokens (EOS and stop token ids to -inf while the output is shorter).
    Everything the host knows (ids, lengths, knobs) is uploaded without waiting; nothing is
    read back. Without `histories` a request counts as having seen no token. Rows in `may_end`
    (a complete grammar that admits only a stop token) are not held back by min_tokens.
    `pending[i]`: tokens row i's request has after its history's output (speculation: the
    tokens accepted this step and the drafts before the row's position), counted as output."""
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    if not rows:
        return logits
    dev, vocab = logits.device, logits.shape[1]
    empty = _NoHistory()
    hist = [histories[i] if histories is not None else empty for i in rows]
    idx = torch.tensor(rows).to(dev, non_blocking=True)
    x = logits[idx]
    pen = [j for j, i in enumerate(rows) if params[i].penalized]
    if pen:
        counts = [_counts_of(hist[j], vocab, dev, params[rows[j]].repetition_penalty != 1) for j in pen]
        knobs = torch.tensor(
            [
                [
                    params[rows[j]].repetition_penalty,
                    params[rows[j]].presence_penalty,
                    params[rows[j]].frequency_penalty,
                ]
                for j in pen
            ],
            dtype=torch.float32,
        ).to(dev, non_blocking=True)
        pidx = torch.tensor(pen).to(dev, non_blocking=True) if len(pen) != len(rows) else None
        y = x if pidx is None else x[pidx]
        out = torch.stack([c.output for c in counts]).float()
        extra = [n * vocab + t for n, j in enumerate(pen) for t in _pending(pending, rows[j]) if 0 <= t < vocab]
        extra_idx = torch.tensor(extra, dtype=torch.long).to(dev, non_blocking=True) if extra else None
        if extra_idx is not None:
            out.view(-1).index_add_(0, extra_idx, torch.ones(len(extra), dtype=out.dtype).to(dev, non_blocking=True))
        if any(params[rows[j]].repetition_penalty != 1 for j in pen):
            seen = torch.stack([c.seen if c.seen is not None else c.output > 0 for c in counts])
            if extra_idx is not None:
                seen.view(-1).index_fill_(0, extra_idx, True)
            rep = knobs[:, :1]
            y = torch.where(seen, torch.where(y > 0, y / rep, y * rep), y)
        y = y.sub_(knobs[:, 2:3] * out).sub_(knobs[:, 1:2] * (out > 0))  # y is this step's own copy
        if pidx is None:
            x = y
        else:
            x.index_copy_(0, pidx, y)
    # logit_bias and min_tokens: sparse (row, token) entries as flat offsets into x (index_add_
    # and index_fill_ need no host read on CUDA), one upload and one op each.
    b_flat, b_vals, m_flat = [], [], []
    for j, (i, h) in enumerate(zip(rows, hist)):
        p = params[i]
        for tok, bias in p.logit_bias.items():
            if 0 <= tok < vocab:  # the API refuses others; an id past the vocab must not reach the device
                b_flat.append(j * vocab + tok), b_vals.append(bias)
        if len(h.output_ids) + len(_pending(pending, i)) < p.min_tokens and i not in may_end:
            blocked = {t for t in (*p.stop_token_ids, *(() if p.ignore_eos else eos_ids)) if 0 <= t < vocab}
            m_flat += [j * vocab + t for t in sorted(blocked)]
    flat = x.view(-1)  # x is this step's own contiguous copy
    if b_flat:
        vals = torch.tensor(b_vals, dtype=x.dtype).to(dev, non_blocking=True)
        flat.index_add_(0, torch.tensor(b_flat).to(dev, non_blocking=True), vals)
    if m_flat:
        flat.index_fill_(0, torch.tensor(m_flat).to(dev, non_blocking=True), float("-inf"))
    if len(rows) == len(params):
        return x  # every row processed: x is the whole batch, in order
    return logits.index_copy(0, idx, x)


def _pending(pending: Optional[Sequence[Sequence[int]]], i: int) -> Sequence[int]:
    return pending[i] if pending is not None else ()


class _NoHistory:
    prompt_ids: list[int] = []
    output_ids: list[int] = []


def _sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], rows: list[int], generators: list[Optional[torch.Generator]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of `rows` of fp32 logits, all rows at once: temperature, top-k and
    top-p as tensors over the batch, then an exponential race (argmax of p / Exp(1), which picks
    i with probability p_i) whose noise each row draws from its own generator. Returns (tokens,
    invalid) as device tensors [len(rows)]; nothing here reads the device from the host."""
    dev = logits.device
    ps = [params[i] for i in rows]
    knobs = torch.tensor(
        [[max(p.temperature, MIN_TEMPERATURE), p.top_k if p.top_k and p.top_k > 0 else 0, p.top_p] for p in ps],
        dtype=torch.float32,
    ).to(dev, non_blocking=True)
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


def skip_draw(generator: torch.Generator, vocab: int) -> None:
    """Move a request's random stream past one sampled token's draw (what `_sample_rows` takes
    from it: one float32 exponential per vocab entry), as if this process had sampled it: PD
    decode continues the stream prefill drew the first token from."""
    torch.empty(vocab, dtype=torch.float32, device=generator.device).exponential_(generator=generator)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[Optional[torch.Generator]],
    histories: Optional[Sequence[TokenHistory]] = None,
    eos_ids: Sequence[int] = (),
    mask: Optional["StepMask"] = None,
) -> list[Union[Sampled, Exception]]:
    """One result per row of fp32 logits [B, V]: a Sampled, or the exception that row raised.
    `histories[i]`: row i's prompt and output so far (for the penalties and min_tokens);
    `eos_ids`: the ids min_tokens holds back besides each request's stop_token_ids;
    `mask`: the grammar masks of the rows with structured output (`dsv4_engine.structured`),
    applied first, as -inf, so that penalties, logit_bias, min_tokens, temperature, top-k/p and
    the logprobs all see only the tokens the grammar allows (as vLLM applies its bitmask).

    The whole batch is sampled with batched tensor ops and read back to the host once (a
    per-row sampler waits for the GPU several times a row). Logprobs are those of the model's
    raw distribution (log-softmax of the logits before penalties, logit_bias, min_tokens,
    temperature, top-k and top-p; after a grammar's mask), the choice vLLM documents as its default."""
    raw = logits.float()
    nan = torch.isnan(raw).any(dim=-1).long() if mask is not None else None  # before -inf hides a NaN
    if mask is not None:
        raw = apply_token_mask(raw, mask.rows, mask.bits)
    logits = process_logits(
        raw, params, histories, eos_ids, frozenset(mask.may_end) if mask is not None else frozenset()
    )
    out: list[Union[Sampled, Exception, None]] = [None] * len(params)
    for i, e in mask.errors.items() if mask is not None else ():
        out[i] = SamplingError(f"structured output: {e}")
    for i, (p, gen) in enumerate(zip(params, generators)):
        if gen is not None and not p.greedy and not same_device(gen.device, logits.device):
            out[i] = SamplingError(f"this request's generator is on {gen.device}, its logits on {logits.device}")
    rows = [i for i, p in enumerate(params) if not p.greedy and out[i] is None]
    if mask is None:
        parts = [logits.argmax(dim=-1), torch.isnan(raw).any(dim=-1).long()]
    else:  # 2: nothing is left to sample (a grammar row whose every token is masked)
        parts = [logits.argmax(dim=-1), nan + 2 * torch.isneginf(logits).all(dim=-1).long()]
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
            if nan_rows[i] & 1:
                raise SamplingError("the model produced NaN logits for this request")
            if nan_rows[i] & 2:
                raise NoTokenAllowed()
            if p.greedy:
                tok = greedy[i]
            else:
                tok, bad = drawn[i]
                if bad:
                    raise SamplingError("the sampling distribution is not finite (check temperature/top_p/top_k)")
            entry = None
            if p.logprobs is not None:
                entry = logprob_entry(torch.log_softmax(raw[i], dim=-1), tok, p.logprobs)
            out[i] = Sampled(tok, entry)
        except Exception as e:  # noqa: BLE001 — whatever one row raises fails that row alone
            out[i] = e
    return out  # type: ignore[return-value]
