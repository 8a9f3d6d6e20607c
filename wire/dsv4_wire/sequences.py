"""How many sequences one request asks the engine to run: each prompt of a completions request
times its candidates (`n`, or `best_of` when larger). One request of 256 prompts with n=16 was
4,096 sequences in the engine's queue, ahead of every other tenant (issue 39); the engine and
the router refuse more than MAX_SEQUENCES_PER_REQUEST, and the router's per-key limits count
sequences, not requests."""

from __future__ import annotations

MAX_SEQUENCES_PER_REQUEST = 256


def _count(v: object) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 1 else 1


def sequence_count(body: dict) -> int:
    """Pure: the sequences of a (not yet validated) request body; malformed fields count as 1,
    the engine refuses them."""
    prompt = body.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1
    return prompts * max(_count(body.get("n")), _count(body.get("best_of")))


def too_many_sequences(count: int) -> str:
    return (
        f"this request asks for {count} sequences (prompts x max(n, best_of)); "
        f"at most {MAX_SEQUENCES_PER_REQUEST} per request"
    )
