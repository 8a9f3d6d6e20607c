"""OpenAI's two logprobs shapes, built from the engine's per-token entries
{"token_id", "logprob", "top": [[token_id, logprob], ...]} (see dsv4_engine.sampling).

Completions (legacy): {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset};
the sampled token is always among its top_logprobs, as OpenAI's legacy API did.
Chat: {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}.
"""

from __future__ import annotations

from typing import Callable, Optional

TokenText = Callable[[int], str]


def completion_logprobs(entries: list[dict], token_text: TokenText, offset: int = 0) -> dict:
    """The completions shape for these tokens; text offsets count from `offset`."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        text = token_text(e["token_id"])
        out["tokens"].append(text)
        out["token_logprobs"].append(e["logprob"])
        top = {token_text(t): lp for t, lp in e["top"]}
        top.setdefault(text, e["logprob"])
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def next_offset(shape: Optional[dict], offset: int) -> int:
    """Where the text offsets of the next chunk of a stream start."""
    if not shape or not shape["tokens"]:
        return offset
    return shape["text_offset"][-1] + len(shape["tokens"][-1])


def _chat_token(token_text: TokenText, token_id: int, logprob: Optional[float]) -> dict:
    text = token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: list[dict], token_text: TokenText) -> dict:
    return {"content": [{**_chat_token(token_text, e["token_id"], e["logprob"]),
                         "top_logprobs": [_chat_token(token_text, t, lp) for t, lp in e["top"]]}
                        for e in entries]}
