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

A plain prompt shorter than the key is its own key, and it changes as the conversation grows.
`ConversationKeys` remembers such short prompts (bounded, least recently used go first): a
later prompt that starts with a whole earlier one is a later round of that conversation and
inherits its key. Only a whole earlier prompt counts, so prompts that merely share a start
(a chat template applied by the client) keep their own keys and still spread.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from typing import Any, Optional, Sequence, Union

KEY_CHARS = 512  # leading characters of a plain prompt (and cap per chat message)
KEY_TOKENS = 128  # leading token ids of a prompt given as ids
MIN_ROOT_CHARS = 16  # shorter earlier prompts ("Hi") say too little to claim later ones
MIN_ROOT_TOKENS = 4
MAX_ROOTS = 16384  # short prompts remembered, per kind (text, token ids)
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
    prompt = _plain_prompt(body)
    if isinstance(prompt, list):
        return "ids:" + ",".join(str(t) for t in prompt[:KEY_TOKENS])
    if isinstance(prompt, str):
        return "text:" + prompt[:KEY_CHARS]
    return None


def _plain_prompt(body: dict) -> Union[str, list, None]:
    """The request's prompt (text, or token ids) when it is a plain one, else None."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]  # a batch: its first prompt (PD serves one prompt per request anyway)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt[:KEY_TOKENS]):
        return prompt
    if isinstance(prompt, str) and prompt:
        return prompt
    return None


class ConversationKeys:
    """`affinity_key`, except that a plain prompt starting with a whole short prompt seen before
    (shorter than the key) gets that prompt's key: it is a later round of the same conversation.
    The router's own state (one instance per router); bounded by `max_roots` per kind."""

    def __init__(self, max_roots: int = MAX_ROOTS):
        self.max_roots = max_roots
        # kind -> {an earlier short prompt (text, or tuple of ids): the key of its conversation}
        self._roots: dict[str, OrderedDict] = {"text": OrderedDict(), "ids": OrderedDict()}
        self._lengths: dict[str, Counter] = {"text": Counter(), "ids": Counter()}  # lengths present

    @property
    def num_roots(self) -> int:
        return sum(len(r) for r in self._roots.values())

    def key(self, path: str, body: dict) -> Optional[str]:
        own = affinity_key(path, body)
        prompt = _plain_prompt(body) if own is not None and "chat" not in path else None
        if prompt is None:
            return own
        kind, limit, least = (
            ("text", KEY_CHARS, MIN_ROOT_CHARS) if isinstance(prompt, str) else ("ids", KEY_TOKENS, MIN_ROOT_TOKENS)
        )
        lead = prompt[:limit] if kind == "text" else tuple(prompt[:limit])
        roots = self._roots[kind]
        key = own
        for n in sorted((n for n in self._lengths[kind] if n <= len(lead)), reverse=True):
            found = roots.get(lead[:n])
            if found is not None:
                roots.move_to_end(lead[:n])
                key = found
                break
        if least <= len(prompt) < limit:
            self._remember(kind, lead, key)
        return key

    def _remember(self, kind: str, lead: Union[str, tuple], key: str) -> None:
        roots, lengths = self._roots[kind], self._lengths[kind]
        if lead not in roots:
            lengths[len(lead)] += 1
        roots[lead] = key
        roots.move_to_end(lead)
        while len(roots) > self.max_roots:
            old, _ = roots.popitem(last=False)
            lengths[len(old)] -= 1
            if not lengths[len(old)]:
                del lengths[len(old)]


def _score(key: str, url: str) -> int:
    return int.from_bytes(
        hashlib.blake2b(f"{url}\x00{key}".encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big"
    )


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
