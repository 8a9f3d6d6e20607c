"""The router's byte pre-scan (issue 39 item 4): nesting and the number of arrays and objects
are bounded from the body's bytes before any JSON parse, exactly as the parse would count them
(brackets in strings, escapes), and the default body limit follows the engines' context length."""

from __future__ import annotations

import json
import random
import time

import pytest

from dsv4_router.body import MAX_CONTAINERS, MAX_DERIVED_BODY, body_limit, parse_body, prescan
from dsv4_wire import APIError


def shape(obj) -> tuple[int, int]:
    """(arrays and objects, depth) of a parsed document."""
    if isinstance(obj, dict):
        kids = [shape(v) for v in obj.values()]
    elif isinstance(obj, list):
        kids = [shape(v) for v in obj]
    else:
        return 0, 0
    return 1 + sum(k[0] for k in kids), 1 + max((k[1] for k in kids), default=0)


def random_doc(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 6 or r < 0.3:
        return rng.choice(["[x]", 'q"uote', "back\\slash\\", "{}", '\\\\"', "]]}", 7, None, "\u00e9[", "\\u005b"])
    if r < 0.65:
        return [random_doc(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["a", "[", '"k"', "\\"]) + str(i): random_doc(rng, depth + 1) for i in range(rng.randint(0, 4))}


def test_the_prescan_counts_what_the_parse_builds():
    rng = random.Random(39)
    for _ in range(400):
        doc = random_doc(rng)
        raw = json.dumps(doc).encode()
        containers, depth = shape(doc)
        for max_containers, max_depth in ((10, 3), (40, 5), (1000, 64)):
            ok = containers <= max_containers and depth <= max_depth
            try:
                prescan(raw, max_depth, max_containers)
                assert ok, (raw, containers, depth)
            except APIError:
                assert not ok, (raw, containers, depth)


def test_a_body_of_millions_of_arrays_is_refused_before_parsing():
    raw = b'{"prompt": [' + b",".join([b"[[1],[2]]"] * 1_000_000) + b"]}"  # ~10 MB, 3 million arrays
    t0 = time.monotonic()
    with pytest.raises(APIError, match=f"more than {MAX_CONTAINERS} arrays"):
        parse_body(raw)
    assert time.monotonic() - t0 < 1.0  # json.loads alone took 6 s here
    text = {"prompt": 'a "quoted" [bracket] \\ {' * 100_000, "max_tokens": 2}
    assert parse_body(json.dumps(text).encode()) == text  # brackets in strings do not count


def test_the_default_body_limit_follows_the_context_length():
    assert body_limit(8192, [131072]) == 8192  # --max-body-bytes wins
    assert body_limit(None, []) == MAX_DERIVED_BODY  # nothing known yet
    assert body_limit(None, [None, 2048]) == (1 << 20) + 32 * 2048
    assert body_limit(None, [4096, 131072]) == (1 << 20) + 32 * 131072
    assert body_limit(None, [1 << 20]) == MAX_DERIVED_BODY
