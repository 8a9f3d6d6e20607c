"""OpenAI's two logprobs shapes, built from the engine's per-token entries
{"token_id", "logprob", "top": [[token_id, logprob], ...]} (see dsv4_engine.sampling).

Completions (legacy): {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset};
the sampled token is always among its top_logprobs, as OpenAI's legacy API did.
Chat: {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}.

A token's text is its own bytes decoded; a token that holds part of a UTF-8 character (byte-level
BPE splits them) is shown as `bytes:\\xNN...`, as OpenAI does, and `bytes` carries the raw bytes.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Optional

TokenText = Callable[[int], str]
TokenBytes = Callable[[int], bytes]


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE spells every byte as one printable character (GPT-2's scheme): bytes that
    are printable stand for themselves, the others are moved up past U+0100 in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def byte_level_token_bytes(piece: str) -> Optional[bytes]:
    """The raw bytes a byte-level BPE token string stands for (None if it is not one, e.g. an
    added special token)."""
    alphabet = _byte_level_alphabet()
    if not piece or any(c not in alphabet for c in piece):
        return None
    return bytes(alphabet[c] for c in piece)


def text_of_bytes(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


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


def _chat_token(token_bytes: TokenBytes, token_id: int, logprob: Optional[float]) -> dict:
    raw = token_bytes(token_id)
    return {"token": text_of_bytes(raw), "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(entries: list[dict], token_bytes: TokenBytes) -> dict:
    return {
        "content": [
            {
                **_chat_token(token_bytes, e["token_id"], e["logprob"]),
                "top_logprobs": [_chat_token(token_bytes, t, lp) for t, lp in e["top"]],
            }
            for e in entries
        ]
    }
