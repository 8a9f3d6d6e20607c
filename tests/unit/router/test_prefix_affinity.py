"""Prefix affinity of the router: the same conversation goes to the same prefill engine round
after round, different conversations spread, and load bounds the preference."""

from __future__ import annotations

import collections

from dsv4_router.affinity import affinity_key, choose, preference
from dsv4_router.workers import WorkerPool

URLS = [f"http://10.0.0.{i}:8100" for i in range(1, 5)]


def chat(*turns: tuple[str, str]) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def test_every_round_of_a_conversation_has_the_same_key():
    r1 = chat(("system", "You are terse."), ("user", "Plan the trip to Lyon."))
    r2 = chat(
        ("system", "You are terse."), ("user", "Plan the trip to Lyon."), ("assistant", "Train."), ("user", "And back?")
    )
    other = chat(("system", "You are terse."), ("user", "Fix my bash script."))
    path = "/v1/chat/completions"
    assert affinity_key(path, r1) == affinity_key(path, r2) != affinity_key(path, other)
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Plan the trip to Lyon."}]}]}
    assert affinity_key(path, parts) == affinity_key(
        path, {"messages": [{"role": "user", "content": "Plan the trip to Lyon."}]}
    )
    # A growing plain prompt keeps its leading characters / token ids.
    base = "x" * 600
    assert affinity_key("/v1/completions", {"prompt": base}) == affinity_key(
        "/v1/completions", {"prompt": base + "more"}
    )
    ids = list(range(300))
    assert affinity_key("/v1/completions", {"prompt": ids}) == affinity_key("/v1/completions", {"prompt": ids + [7]})
    assert affinity_key("/v1/completions", {"prompt": ""}) is None and affinity_key("/v1/completions", {}) is None


def test_keys_spread_and_a_removed_worker_moves_only_its_own_keys():
    keys = [f"conversation {i}" for i in range(400)]
    first = {k: preference(k, URLS)[0] for k in keys}
    counts = collections.Counter(first.values())
    assert len(counts) == 4 and min(counts.values()) > 60, counts
    gone = URLS[0]
    after = {k: preference(k, URLS[1:])[0] for k in keys}
    assert all(after[k] == first[k] for k in keys if first[k] != gone)


def test_the_preferred_worker_wins_until_it_is_much_busier():
    key = "conversation 7"
    fav = preference(key, URLS)[0]
    idle = {u: 0 for u in URLS}
    assert choose(key, idle) == fav
    assert choose(key, {**idle, fav: 4}) == fav  # within the slack of the least busy
    moved = choose(key, {**idle, fav: 5})
    assert moved == preference(key, URLS)[1]  # the key's second choice, not a random one
    busy = {u: 10 for u in URLS}
    assert choose(key, {**busy, fav: 20}) == fav  # 2x the least busy is still fine
    assert choose(key, {**busy, fav: 21}) != fav


def test_one_hot_key_never_starves_the_others():
    """Every request with the same key: the load spreads once the favourite is busy enough."""
    loads = {u: 0 for u in URLS}
    for _ in range(200):
        loads[choose("same system prompt", loads)] += 1
    assert min(loads.values()) > 0 and max(loads.values()) <= 2 * min(loads.values()) + 4, loads


def test_pool_pick_uses_the_key_among_ready_workers_only():
    pool = WorkerPool()
    for u in URLS:
        pool.add(u, "prefill").healthy = True
    key = "conversation 3"
    fav = preference(key, URLS)[0]
    assert pool.pick("prefill", key=key).url == fav
    pool.workers[fav].healthy = False
    assert pool.pick("prefill", key=key).url == preference(key, [u for u in URLS if u != fav])[0]
    assert pool.pick("prefill", exclude={preference(key, URLS)[1]}, key=key).url != preference(key, URLS)[1]
