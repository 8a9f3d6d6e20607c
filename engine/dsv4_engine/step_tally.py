"""Running totals of the engine's forward steps, by kind, for the operator's planner.

The planner fits a linear model of a step's time (docs/operations.md, "The planner"): a decode
step takes a + b*batch + c*(batch x context), a prefill step p0 + p1*tokens + p2*(tokens x
context). Every term is linear in the coefficients, so the sums over many steps fit them as well
as the steps one by one would: the engine keeps, per kind, the number of steps, their seconds and
the sums of each term, and the planner fits on the differences between two reads of /v1/loads.

Kinds: `decode` (every request of the batch computes one token), `prefill` (every request
computes more than one: a prompt or a chunk of it) and `mixed` (both in one batch, which PD
engines do not run; a mono engine's mixed steps are kept apart so they do not blur either fit).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol


class _Scheduled(Protocol):
    num_new: int

    @property
    def seq(self) -> object: ...


@dataclass
class KindTally:
    steps: int = 0
    seconds: float = 0.0
    requests: int = 0  # sum over steps of the batch's requests
    tokens: int = 0  # sum over steps of the tokens computed
    request_context: int = 0  # sum over steps and requests of the request's context (tokens) after the step
    token_context: int = 0  # sum over steps and requests of tokens computed x that context

    def as_dict(self) -> dict[str, float]:
        return {
            "steps": self.steps,
            "seconds": round(self.seconds, 6),
            "requests": self.requests,
            "tokens": self.tokens,
            "request_context": self.request_context,
            "token_context": self.token_context,
        }


@dataclass
class StepTally:
    kinds: dict[str, KindTally] = field(
        default_factory=lambda: {"decode": KindTally(), "prefill": KindTally(), "mixed": KindTally()}
    )

    def record(self, batch: Iterable[_Scheduled], seconds: float) -> None:
        """One step: `batch` as scheduled (before the step's tokens are counted computed)."""
        items = [(int(b.num_new), int(getattr(b.seq, "num_computed", 0)) + int(b.num_new)) for b in batch]
        if not items:
            return
        ones = sum(1 for new, _ in items if new <= 1)
        kind = "decode" if ones == len(items) else "prefill" if ones == 0 else "mixed"
        t = self.kinds[kind]
        t.steps += 1
        t.seconds += max(0.0, seconds)
        t.requests += len(items)
        t.tokens += sum(new for new, _ in items)
        t.request_context += sum(ctx for _, ctx in items)
        t.token_context += sum(new * ctx for new, ctx in items)

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {kind: t.as_dict() for kind, t in self.kinds.items()}
