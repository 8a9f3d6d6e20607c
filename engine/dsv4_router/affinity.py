"""Prefix affinity: send a conversation to the engine that most likely still caches its prefix.

The router cannot see the engines' caches, but it can see what makes two requests share a
prefix: the same conversation re-sends its start every round. `affinity_key` takes that start
(for chat: the system message and the first other message, which every later round repeats
verbatim; for a plain prompt: its leading characters or token ids, short enough that every
round of a growing prompt shares them), and rendezvous hashing (highest score of
hash(key, worker) wins) maps it to a worker; adding or removing a worker moves only the keys
that worker wins or loses.

Bounded: the preferred worker is taken only while it is not much busier than the least busy
one (in-flight count at most max(2x, +4) the least's); otherwise the next worker in the key's
order that is within the bound, so one hot conversation (or many sharing one system prompt
behind a plain-prompt API) never starves the rest. Pure functions: the router feeds them its
own in-flight counts.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional, Sequence

KEY_CHARS = 512  # leading characters of a plain prompt (and cap per chat message)
KEY_TOKENS = 128  # leading token ids of a prompt given as ids
LOAD_FACTOR = 2.0
LOAD_SLACK = 4


def _text(content: Any) -> str:
    """A chat message's content as text (a string, or the text parts of a list of parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def affinity_key(path: str, body: dict) -> Optional[str]:
    """What identifies the request's conversation, or None when there is nothing to go on."""
    messages = body.get("messages")
    if "chat" in path and isinstance(messages, list) and messages:
        msgs = [m for m in messages if isinstance(m, dict)]
        lead = [m for m in msgs if m.get("role") == "system"][:1]
        lead += [m for m in msgs if m.get("role") != "system"][:1]
        key = "\x1e".join(f"{m.get('role')}\x1f{_text(m.get('content'))[:KEY_CHARS]}" for m in lead)
        return key or None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]  # a batch: its first prompt (PD serves one prompt per request anyway)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt[:KEY_TOKENS]):
        return "ids:" + ",".join(str(t) for t in prompt[:KEY_TOKENS])
    if isinstance(prompt, str) and prompt:
        return "text:" + prompt[:KEY_CHARS]
    return None


def _score(key: str, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{url}\x00{key}".encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


def preference(key: str, urls: Sequence[str]) -> list[str]:
    """The workers in the order this key prefers them (rendezvous hashing)."""
    return sorted(urls, key=lambda u: _score(key, u), reverse=True)


def within_bound(inflight: int, least: int) -> bool:
    return inflight <= max(least * LOAD_FACTOR, least + LOAD_SLACK)


def choose(key: str, loads: dict[str, int]) -> str:
    """The worker for this key among {url: in-flight requests}: the most preferred one that is
    not much busier than the least busy (the least busy always qualifies)."""
    if not loads:
        raise ValueError("no worker to choose from")
    least = min(loads.values())
    for url in preference(key, list(loads)):
        if within_bound(loads[url], least):
            return url
    raise AssertionError("unreachable: the least busy worker is within the bound")
