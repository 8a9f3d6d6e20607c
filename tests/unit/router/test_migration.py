"""Migration's pure parts: which engine errors move a request, what the client is sent of an
engine's events (id, created and token ids), and the body of each re-send."""

from __future__ import annotations

import json

import pytest

from dsv4_router.body import parse_body
from dsv4_router.migration import ERROR_EVENT, TRUNCATED, Resume, allowed_resends, retryable
from dsv4_wire import APIError


def ev(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def chunk(rid, created, text, ids, finish=None):
    return ev(
        {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": "m",
            "choices": [{"index": 0, "text": text, "token_ids": ids, "finish_reason": finish, "logprobs": None}],
        }
    )


def events(raw: bytes) -> list:
    return [json.loads(e[6:]) if e[6:] != b"[DONE]" else "[DONE]" for e in raw.split(b"\n\n") if e]


def test_5xx_and_server_errors_move_4xx_do_not():
    assert retryable(
        {"error": {"message": "request aborted: server shutting down", "type": "server_error", "code": 503}}
    )
    assert retryable({"error": {"message": "x", "type": "server_error", "code": 502}})
    assert retryable({"error": {"message": "x", "type": "server_error", "code": "engine_gone"}})
    assert not retryable({"error": {"message": "bad", "type": "invalid_request_error", "code": 400}})
    assert not retryable({"error": "text"})
    assert not retryable({"error": {"message": "x", "type": "invalid_request_error", "code": True}})


def test_filter_keeps_the_clients_id_and_created_and_collects_tokens():
    st = Resume("cmpl-a", {"prompt": "hi"}, stream=True)
    out, what = st.filter(chunk("cmpl-a", 100, "He", [5]) + chunk("cmpl-a", 100, "llo", [6, 7]))
    assert what is None and st.tokens == [5, 6, 7] and st.started
    assert all("token_ids" not in c for e in events(out) for c in e["choices"])  # not asked by the client
    # the next engine answers under its own id and time: the client sees the first ones
    out, what = st.filter(chunk("cmpl-a-m1", 200, " you", [8], "length") + ev(b"[DONE]"))
    got = events(out)
    assert what == "done" and got[-1] == "[DONE]"
    assert got[0]["id"] == "cmpl-a" and got[0]["created"] == 100 and st.finished
    assert st.tokens == [5, 6, 7, 8]


def test_filter_keeps_token_ids_the_client_asked_for():
    st = Resume("r", {}, stream=True, client_wants_ids=True)
    out, _ = st.filter(chunk("r", 1, "a", [9]))
    assert events(out)[0]["choices"][0]["token_ids"] == [9]


def test_filter_stops_at_a_retryable_error_and_keeps_what_came_before():
    st = Resume("r", {}, stream=True)
    err = ev({"error": {"message": "request aborted: x", "type": "server_error", "param": None, "code": 503}})
    out, what = st.filter(chunk("r", 1, "a", [1]) + err + ev(b"[DONE]"))
    assert what == ERROR_EVENT and len(events(out)) == 1 and st.tokens == [1]


def test_filter_passes_a_client_error_and_calls_an_unfinished_done_a_cut():
    st = Resume("r", {}, stream=True)
    bad = ev({"error": {"message": "no", "type": "invalid_request_error", "param": None, "code": 400}})
    out, what = st.filter(bad)
    assert what is None and b"invalid_request_error" in out
    out, what = st.filter(chunk("r", 1, "a", [1]) + ev(b"[DONE]"))
    assert what == TRUNCATED  # [DONE] without a finish_reason: the engine stopped short


def test_each_resend_carries_the_answer_so_far_under_its_own_rid():
    st = Resume("r", {"prompt": [1, 2], "max_tokens": 9, "stream": True}, stream=True)
    first = st.attempt_body()
    assert first["rid"] == "r" and first["return_token_ids"] is True and "continuation_token_ids" not in first
    st.attempts, st.tokens = 1, [4, 5]
    again = st.attempt_body()
    assert again["rid"] == "r-m1" and again["continuation_token_ids"] == [4, 5] and again["max_tokens"] == 9
    assert "continuation_token_ids" not in st.body  # the client's body itself is never changed


def test_migration_limit_zero_keeps_the_one_retry_before_any_output():
    assert allowed_resends(0, started=False) == 1 and allowed_resends(0, started=True) == 0
    assert allowed_resends(3, started=True) == 3


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "\\ud800"}',
        b'{"prompt": "a\\udfffb"}',
        b'{"\\ud800": 1}',
        b'{"messages": [{"role": "user", "content": "\\udc00"}]}',
    ],
)
def test_lone_surrogates_are_a_400_not_a_500(raw):
    with pytest.raises(APIError) as e:
        parse_body(raw)
    assert e.value.status == 400 and "surrogate" in e.value.message


def test_a_surrogate_pair_is_a_character():
    assert parse_body(b'{"prompt": "\\ud83d\\ude00"}')["prompt"] == "\U0001f600"


def ichunk(rid, j, text, ids, finish=None):
    return ev(
        {
            "id": rid,
            "object": "text_completion",
            "created": 7,
            "model": "m",
            "choices": [{"index": j, "text": text, "token_ids": ids, "finish_reason": finish, "logprobs": None}],
        }
    )


def test_n_choices_are_tracked_per_index_and_split_into_one_request_each():
    from dsv4_router.migration import choice_seed
    from dsv4_wire.choices import choice_seed as engine_choice_seed

    st = Resume("r", {"prompt": "hi", "n": 3, "seed": 2**63 - 2, "stream": True}, stream=True)
    out, what = st.filter(
        ichunk("r", 0, "a", [1])
        + ichunk("r", 2, "b", [2])
        + ichunk("r", 0, "c", [3])
        + ichunk("r", 1, "d", [4], "length")
    )
    assert what is None and not st.finished
    assert st.choice_tokens == {0: [1, 3], 2: [2], 1: [4]} and st.choice_done == {1}
    kids = [st.child(j) for j in (0, 2)]
    for j, kid in zip((0, 2), kids):
        body = kid.attempt_body()
        assert body["n"] == 1 and body["seed"] == engine_choice_seed(2**63 - 2, j) == choice_seed(2**63 - 2, j)
        assert body["continuation_token_ids"] == st.choice_tokens[j]
        assert body["rid"] == f"r-c{j}-m{st.attempts}" or st.attempts == 0
    # a child's events are the client's index j under the client's id; its usage and [DONE] wait
    out, what = kids[1].filter(
        ichunk("r-c2-m1", 0, "e", [5], "length")
        + ev(
            {
                "id": "x",
                "object": "text_completion",
                "created": 9,
                "model": "m",
                "choices": [],
                "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
            }
        )
        + ev(b"[DONE]")
    )
    got = events(out)
    assert what == "done" and len(got) == 1 and got[0]["choices"][0]["index"] == 2 and got[0]["id"] == "r"
    assert got[0]["created"] == 7 and st.choice_tokens[2] == [2, 5] and 2 in st.choice_done
    kids[0].filter(
        ichunk("r-c0-m1", 0, "f", [6, 7], "length")
        + ev(
            {
                "id": "y",
                "object": "text_completion",
                "created": 9,
                "model": "m",
                "choices": [],
                "usage": {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8},
            }
        )
    )
    u = st.usage()["usage"]
    assert u == {"prompt_tokens": 4, "completion_tokens": 4 + 1 + 2, "total_tokens": 11}  # prompt once
    assert st.finished


def test_a_choice_restarted_from_nothing_sends_no_second_role_chunk():
    st = Resume("c", {"messages": [], "n": 2, "stream": True}, stream=True)
    role = ev(
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [{"index": 1, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        }
    )
    st.filter(role)
    kid = st.child(1)
    again = role.replace(b'"index": 1', b'"index": 0')
    out, _ = kid.filter(again)
    assert out == b""
    out, _ = kid.filter(
        ev(
            {
                "id": "c-c1",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "m",
                "choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [3], "finish_reason": None}],
            }
        )
    )
    assert events(out)[0]["choices"][0] == {"index": 1, "delta": {"content": "x"}, "finish_reason": None}


def test_several_prompts_count_every_choice_but_are_not_split():
    st = Resume("r", {"prompt": [[1, 2], [3]], "n": 2}, stream=True)
    assert st.n == 4 and not st.splittable
    st.filter(ichunk("r", 0, "a", [1], "length") + ichunk("r", 3, "b", [2], "length"))
    assert not st.finished  # two of four choices ended: a break now is not the end
    assert Resume("r", {"prompt": [1, 2], "n": 2}, stream=True).splittable
    assert Resume("r", {"prompt": ["one text"], "n": 3}, stream=True).n == 3


def engine_event(rid, created, delta, ids, finish=None, usage=False, logprobs=None) -> bytes:
    """An event as dsv4's engine writes it (json.dumps' default separators, token_ids last)."""
    c = {"index": 0, "finish_reason": finish, "logprobs": logprobs, "delta": delta, "token_ids": ids}
    obj = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": "m", "choices": [c]}
    if usage:
        obj["usage"] = None
    return ev(obj)


@pytest.mark.parametrize("wants_ids", [False, True])
@pytest.mark.parametrize("usage", [False, True])
def test_plain_deltas_are_relayed_as_bytes_identical_to_the_json_path(wants_ids, usage):
    stream = [
        ev(
            {
                "id": "r",
                "object": "chat.completion.chunk",
                "created": 7,
                "model": "m",
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
            }
        ),
        engine_event("r", 7, {"content": "He"}, [5], usage=usage),
        engine_event("r", 7, {"content": 'say "token_ids": [1] \u00e9\\n'}, [6, 7], usage=usage),
        engine_event("r", 7, {"reasoning_content": "hm"}, [], usage=usage),
        engine_event("r", 7, {"content": "x"}, [8], logprobs={"content": [{"token": "x", "logprob": -0.5}]}),
        engine_event("r", 7, {"content": "!"}, [9], finish="stop", usage=usage),
        ev(b"[DONE]"),
    ]
    fast = Resume("r", {}, stream=True, client_wants_ids=wants_ids)
    slow = Resume("r", {}, stream=True, client_wants_ids=wants_ids)
    direct = Resume("r", {}, stream=True, client_wants_ids=wants_ids)  # the read callback's path
    outs, taken = [], 0
    for e in stream:
        outs.append(fast.filter(e))
        slow.head = None  # never the bytes path
        assert slow.filter(e) == outs[-1]
        plain = direct.plain_event(e)
        taken += plain is not None
        assert (plain if plain is not None else direct.filter(e)[0]) == outs[-1][0]
    assert fast.head is not None and fast.tokens == slow.tokens == direct.tokens == [5, 6, 7, 8, 9]
    assert direct.choice_tokens == {0: [5, 6, 7, 8, 9]} and taken == 4  # the plain deltas
    assert outs[-1][1] == "done" and fast.finished


def test_events_between_the_first_and_the_last_decode_no_json(monkeypatch):
    st = Resume("r", {}, stream=True)
    st.filter(engine_event("r", 7, {"content": "a"}, [1]))

    def no_json(*a, **k):
        raise AssertionError("the JSON path was taken")

    more = b"".join(engine_event("r", 7, {"content": c}, [i]) for i, c in enumerate("bcd", 2))
    monkeypatch.setattr(json, "loads", no_json)
    monkeypatch.setattr(json, "dumps", no_json)
    out, what = st.filter(more)
    monkeypatch.undo()
    assert (
        what is None
        and st.tokens == [1, 2, 3, 4]
        and [e["choices"][0]["delta"]["content"] for e in events(out)]
        == [
            "b",
            "c",
            "d",
        ]
    )


def test_the_bytes_path_leaves_a_moved_request_to_the_json_path():
    st = Resume("r", {}, stream=True)
    st.filter(engine_event("r", 7, {"content": "a"}, [1]))
    assert st.head is not None
    st.attempts = 2  # the next engine answers under its own id and time: rewritten to the client's
    out, _ = st.filter(engine_event("r-m1", 9, {"content": "b"}, [2]))
    assert events(out)[0]["id"] == "r" and events(out)[0]["created"] == 7 and st.tokens == [1, 2]


def test_only_a_chunk_that_is_exactly_one_plain_delta_takes_the_bytes_path():
    st = Resume("r", {}, stream=True)
    st.filter(engine_event("r", 7, {"content": "a"}, [1]))  # the first event: sets the head
    one = engine_event("r", 7, {"content": "b"}, [2])
    for chunk in (
        one + one,  # two events: the loop's
        one[:-1],  # half an event
        engine_event("r", 7, {"content": "c"}, [3], finish="stop"),  # a finish
        engine_event("s", 7, {"content": "d"}, [4]),  # another engine's id
        one.replace(b"[2]", b"[x]"),  # ids that are no ids
    ):
        assert st.plain_event(chunk) is None
    assert st.tokens == [1] and st.choice_tokens == {0: [1]}  # nothing recorded on the way
    assert st.plain_event(one) is not None and st.tokens == [1, 2]
    assert st.plain_event(engine_event("r", 7, {"content": "e"}, [])) is not None  # no ids: none recorded
    assert st.tokens == [1, 2] and st.choice_tokens == {0: [1, 2]}
