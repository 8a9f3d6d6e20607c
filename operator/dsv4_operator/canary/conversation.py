"""The probe's workload: an agent conversation replayed from a seed. Each round the client sends
the whole history and the engine answers; then the history grows by the answer plus a
tool-call-sized addition (a tool result, the next instruction), until the context reaches its
share of the model's. What the engine answers does not change the history (it is replayed), so
every revision sees the same prompts and their figures compare. Pure."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class ConversationShape:
    system_tokens: int = 64  # the first prompt: a system prompt and the task
    growth_tokens: int = 96  # added each round: a tool call's result and the next turn
    answer_tokens: int = 16  # max_tokens of each round (the assistant's turn)
    max_rounds: int = 32
    context_share: float = 0.5  # stop growing once the prompt would pass this share of the context
    vocab: int = 256  # token ids drawn from [2, vocab): valid for every checkpoint we ship

    def __post_init__(self) -> None:
        if self.system_tokens < 1 or self.growth_tokens < 1 or self.answer_tokens < 1 or self.max_rounds < 1:
            raise ValueError("conversation sizes must be positive")
        if not 0.0 < self.context_share <= 1.0:
            raise ValueError("context_share must be in (0, 1]")
        if self.vocab < 3:
            raise ValueError("vocab must be at least 3")


def context_target(shape: ConversationShape, max_model_len: int) -> int:
    """The longest prompt the probe sends: its share of the context, leaving room for the answer."""
    return max(shape.system_tokens, min(int(max_model_len * shape.context_share), max_model_len - shape.answer_tokens))


def rounds(shape: ConversationShape, max_model_len: int, seed: int) -> list[list[int]]:
    """The prompts of one conversation, round by round: each one extends the one before (a
    replayed answer of `answer_tokens` and then `growth_tokens` more), none past the target."""
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(2, shape.vocab) for _ in range(n)]  # noqa: E731
    target = context_target(shape, max_model_len)
    history = draw(min(shape.system_tokens, target))
    out = [list(history)]
    while len(out) < shape.max_rounds:
        grown = history + draw(shape.answer_tokens) + draw(shape.growth_tokens)
        if len(grown) > target:
            break
        history = grown
        out.append(list(history))
    return out
