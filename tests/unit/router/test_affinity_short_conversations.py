"""Prefix affinity at its edges: a plain-prompt conversation whose first rounds are shorter than
the key (512 characters, 128 token ids) still keeps every round on one engine, unrelated
conversations still spread, and the memory that makes it so stays bounded."""

from __future__ import annotations

import collections
import random

from dsv4_router.affinity import KEY_CHARS, KEY_TOKENS, ConversationKeys, affinity_key, preference

URLS = [f"http://10.0.0.{i}:8100" for i in range(1, 5)]
PATH = "/v1/completions"


def rounds_text(rng: random.Random, first: int, grow: int, n: int) -> list[str]:
    """A growing plain-text conversation: each round re-sends the last one and adds to it."""
    words = "plan route hills stop lunch river ridge camp morning map water".split()
    convo = " ".join(rng.choice(words) for _ in range(first // 5))[:first]
    out = [convo]
    for _ in range(n - 1):
        convo += " " + " ".join(rng.choice(words) for _ in range(grow // 5))
        out.append(convo)
    return out


def rounds_ids(rng: random.Random, first: int, grow: int, n: int) -> list[list[int]]:
    convo = [rng.randrange(3, 400) for _ in range(first)]
    out = [list(convo)]
    for _ in range(n - 1):
        convo += [rng.randrange(3, 400) for _ in range(grow)]
        out.append(list(convo))
    return out


def test_every_round_of_a_short_growing_plain_prompt_prefers_one_engine():
    """Round 1 is shorter than the key, later rounds grow past it: without memory each round
    had its own key, so the rounds scattered over the engines and missed their cache."""
    rng = random.Random(1)
    keys = ConversationKeys()
    for conv in range(30):
        text = rounds_text(rng, rng.randint(20, 200), 150, 5)  # crosses KEY_CHARS by round 4 or 5
        ids = rounds_ids(rng, rng.randint(5, 60), 40, 5)  # crosses KEY_TOKENS
        assert len(text[-1]) > KEY_CHARS and len(ids[-1]) > KEY_TOKENS
        for prompts in (text, ids, [[p] for p in text]):  # a one-prompt batch too
            favs = {preference(keys.key(PATH, {"prompt": p}), URLS)[0] for p in prompts}
            assert len(favs) == 1, (conv, prompts[0])


def test_unrelated_short_prompts_still_spread_and_a_shared_start_is_not_a_conversation():
    rng = random.Random(2)
    keys = ConversationKeys()
    template = "<|user|> "  # every prompt starts the same way (a client-side chat template)
    first = collections.Counter()
    for i in range(400):
        p = template + f"question {i}: " + " ".join(str(rng.random()) for _ in range(3))
        first[preference(keys.key(PATH, {"prompt": p}), URLS)[0]] += 1
    assert len(first) == 4 and min(first.values()) > 60, first
    # A whole earlier prompt that is too short to mean anything does not capture later ones.
    keys.key(PATH, {"prompt": "Hi"})
    assert keys.key(PATH, {"prompt": "Hi there, plan my week"}) == affinity_key(
        PATH, {"prompt": "Hi there, plan my week"}
    )


def test_chat_keys_are_unchanged_and_the_memory_is_bounded():
    keys = ConversationKeys(max_roots=50)
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Plan it."}]}
    assert keys.key("/v1/chat/completions", chat) == affinity_key("/v1/chat/completions", chat)
    rng = random.Random(3)
    for i in range(500):
        keys.key(PATH, {"prompt": f"conversation {i} " + "x" * rng.randint(10, 300)})
        keys.key(PATH, {"prompt": [rng.randrange(3, 400) for _ in range(rng.randint(4, 100))]})
    assert keys.num_roots <= 2 * 50
    assert keys.key(PATH, {}) is None and keys.key(PATH, {"prompt": ""}) is None
