"""The pure rules behind n > 1 and best_of: choice seeds (vLLM's seed + j), PD rooms derived per
sequence, best_of's ranking, and what the protocol refuses."""

from __future__ import annotations

import pytest

from dsv4_serve.protocol import INT64_MAX, INT64_MIN, MAX_N, ChatCompletionRequest, CompletionRequest, parse_request
from dsv4_wire.choices import choice_seed
from dsv4_serve.choices import best_choices, choice_room
from dsv4_wire import APIError


def test_choice_seeds_are_seed_plus_j_within_int64():
    assert choice_seed(None, 3) is None
    assert [choice_seed(10, j) for j in range(3)] == [10, 11, 12]
    assert choice_seed(-5, 2) == -3
    assert choice_seed(INT64_MAX, 1) == INT64_MIN  # wraps instead of leaving the range the engine accepts
    assert choice_seed(INT64_MAX - 1, 1) == INT64_MAX


def test_rooms_are_derived_alike_on_both_sides_and_stay_distinct():
    room = 123456789
    assert choice_room(room, 0) == room  # n = 1 is unchanged
    rooms = [choice_room(room, i) for i in range(MAX_N * 8)]
    assert rooms == [choice_room(room, i) for i in range(MAX_N * 8)]  # deterministic: prefill and decode agree
    assert len(set(rooms)) == len(rooms) and all(0 <= r < 2**63 for r in rooms)
    assert choice_room(room + 1, 1) != choice_room(room, 2)  # not room + index: neighbours' rooms do not meet


def test_best_of_keeps_the_highest_cumulative_logprobs_in_order():
    assert best_choices([-3.0, -1.0, -2.0, -0.5], 2) == [3, 1]
    assert best_choices([-1.0, -1.0, -2.0], 2) == [0, 1]  # ties keep the candidates' order
    assert best_choices([-4.0], 1) == [0]


def parse(model, **body):
    import json

    return parse_request(model, json.dumps(body).encode())


@pytest.mark.parametrize(
    "model,base",
    [(CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]})],
)
def test_n_and_best_of_limits(model, base):
    assert parse(model, **base, n=MAX_N).candidates == MAX_N
    assert parse(model, **base, n=2, best_of=5).candidates == 5
    assert parse(model, **base, n=3).candidates == 3
    for bad, param in (
        ({"n": 0}, "n"),
        ({"n": MAX_N + 1}, "n"),
        ({"best_of": MAX_N + 1}, "best_of"),
        ({"best_of": 0}, "best_of"),
    ):
        with pytest.raises(APIError) as e:
            parse(model, **base, **bad)
        assert e.value.param == param, bad
    for bad in ({"n": 3, "best_of": 2}, {"n": 2, "best_of": 3, "stream": True}):
        with pytest.raises(APIError) as e:  # checked with the other sampling fields, before any compute
            parse(model, **base, **bad).sampling_params(16, 100)
        assert e.value.param == "best_of", bad
    parse(model, **base, n=3, best_of=3, stream=True).sampling_params(16, 100)  # best_of == n streams
