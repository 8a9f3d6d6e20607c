"""The Responses API as a translation onto chat completions (dsv4_wire.agent_apis), without I/O:
requests to chat bodies, chat answers and chat streams to responses and their event sequence,
stored responses and their bound. The real servers: tests/integration/test_agent_apis_http.py."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from dsv4_wire import APIError
from dsv4_wire.agent_apis.edge import AgentCall, RESPONSES, responses_call, stored
from dsv4_wire.agent_apis.responses_output import ResponsesStream, assistant_message, response_from_chat
from dsv4_wire.agent_apis.responses_request import responses_to_chat
from dsv4_wire.agent_apis.store import ResponseStore

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}


def chat_of(body: dict, history=None) -> dict:
    return responses_to_chat(body, history).chat


def test_text_input_with_instructions_and_sampling_fields():
    chat = chat_of(
        {
            "model": "m",
            "input": "hi",
            "instructions": "be brief",
            "max_output_tokens": 7,
            "temperature": 0,
            "top_p": 0.5,
            "reasoning": {"effort": "high"},
            "tools": [TOOL],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "parallel_tool_calls": False,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}},
            "stream": True,
        }
    )
    assert chat == {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "model": "m",
        "max_tokens": 7,
        "temperature": 0,
        "top_p": 0.5,
        "parallel_tool_calls": False,
        "tools": [
            {
                "type": "function",
                "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "reasoning_effort": "high",
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True},
        },
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_items_fold_into_chat_turns():
    items = [
        {"role": "developer", "content": "rules"},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        },
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me look"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": ""},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        {"type": "function_call", "call_id": "c3", "name": "g", "arguments": "{}"},
    ]
    assert chat_of({"input": items})["messages"] == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "ab"},
        {
            "role": "assistant",
            "content": "let me look",
            "reasoning_content": "think",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                {"id": "c2", "type": "function", "function": {"name": "f", "arguments": ""}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c3", "type": "function", "function": {"name": "g", "arguments": "{}"}}],
        },
    ]


def test_history_comes_first_and_instructions_are_not_carried():
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    req = responses_to_chat({"input": "next", "instructions": "new rules"}, history)
    assert req.chat["messages"] == [
        {"role": "system", "content": "new rules"},
        *history,
        {"role": "user", "content": "next"},
    ]
    assert req.messages == [*history, {"role": "user", "content": "next"}]  # what is stored: no instructions


@pytest.mark.parametrize(
    "field, value",
    [
        ("background", True),
        ("conversation", "conv_1"),
        ("include", ["file_search_call.results"]),
        ("truncation", "auto"),
        ("reasoning", {"summary": "auto"}),
        ("tools", [{"type": "web_search"}]),
        ("tool_choice", {"type": "file_search"}),
        ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]),
        ("input", [{"type": "item_reference", "id": "msg_1"}]),
        ("input", [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]),
        ("text", {"format": {"type": "grammar"}}),
        ("top_logprobs", 3),
        ("max_tool_calls", 2),
        ("moderation", {"input": True}),
        ("service_tier", "flex"),
        ("reasoning", {"mode": "pro"}),
        ("reasoning", {"context": "all_turns"}),
        ("tools", [{"type": "function", "name": "f", "defer_loading": True}]),
        ("tools", [{"type": "function", "name": "f", "async": True}]),
        ("tools", [{"type": "function", "name": "f", "output_schema": {"type": "object"}}]),
        ("tools", [{"type": "function", "name": "f", "allowed_callers": ["code_interpreter"]}]),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(field, value):
    body = {"input": "hi", field: value}
    with pytest.raises(APIError) as e:
        responses_to_chat(body)
    assert e.value.status == 400
    assert field in e.value.message or field == (e.value.param or "").split(".")[0]


def test_neutral_values_of_those_fields_pass():
    chat_of({"input": "hi", "background": False, "include": [], "truncation": "disabled", "store": False, "user": "u"})
    chat_of({"input": "hi", "reasoning": {"context": "auto", "mode": "standard"}})
    chat_of({"input": "hi", "tools": [{"type": "function", "name": "f", "defer_loading": False, "async": False}]})


def chat_answer(finish="tool_calls", reasoning="why", content="text", calls=(("c1", "f", '{"a": 1}'),)):
    return {
        "id": "chatcmpl-1",
        "created": 5,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "finish_reason": finish,
                "message": {
                    "role": "assistant",
                    "content": content,
                    "reasoning_content": reasoning,
                    "tool_calls": [
                        {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls
                    ],
                },
            }
        ],
        "usage": {
            "prompt_tokens": 10,
            "completion_tokens": 4,
            "total_tokens": 14,
            "prompt_tokens_details": {"cached_tokens": 6},
            "completion_tokens_details": {"reasoning_tokens": 2},
        },
    }


def test_a_chat_answer_as_a_response():
    req = responses_to_chat({"input": "hi", "tools": [TOOL], "metadata": {"k": "v"}})
    r = response_from_chat(req, chat_answer(), "resp_1")
    assert (r["id"], r["object"], r["status"], r["model"], r["metadata"]) == (
        "resp_1",
        "response",
        "completed",
        "m",
        {"k": "v"},
    )
    assert [o["type"] for o in r["output"]] == ["reasoning", "message", "function_call"]
    assert r["output"][0]["content"] == [{"type": "reasoning_text", "text": "why"}]
    assert r["output"][1]["content"][0]["text"] == "text"
    assert {k: r["output"][2][k] for k in ("call_id", "name", "arguments")} == {
        "call_id": "c1",
        "name": "f",
        "arguments": '{"a": 1}',
    }
    assert r["usage"] == {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 6},
        "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 2},
        "total_tokens": 14,
    }
    cut = response_from_chat(req, chat_answer(finish="length", calls=()), "resp_2")
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    # what a later round re-renders: the same assistant turn the chat path answered
    assert assistant_message(r["output"]) == {k: v for k, v in chat_answer()["choices"][0]["message"].items()}


def chat_chunks() -> list[dict]:
    def ch(delta=None, finish=None):
        return {
            "id": "c",
            "object": "chat.completion.chunk",
            "model": "m",
            "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}],
        }

    return [
        ch({"role": "assistant", "content": ""}),
        ch({"reasoning_content": "wh"}),
        ch({"reasoning_content": "y"}),
        ch({"content": "te"}),
        ch({"content": "xt"}),
        ch({"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}]}),
        ch({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}),
        ch({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
        ch({}, "tool_calls"),
        {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [], "usage": chat_answer()["usage"]},
    ]


def test_a_chat_stream_as_the_official_event_sequence():
    req = responses_to_chat({"input": "hi", "stream": True})
    s = ResponsesStream(req, "resp_1")
    events = [e for c in chat_chunks() for e in s.feed(c)] + s.finish()
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    whole = response_from_chat(req, chat_answer(), "resp_1")
    strip = lambda items: [{k: v for k, v in o.items() if k != "id"} for o in items]
    assert strip(final["output"]) == strip(whole["output"]) and final["usage"] == whole["usage"]
    # the items announced and finished are the final ones, each at its output_index
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [(e["output_index"], e["item"]) for e in done] == list(enumerate(final["output"]))
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert args == final["output"][2]["arguments"] == '{"a": 1}'


def sse_bytes(chunks: list[dict], done=True) -> bytes:
    out = b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks)
    return out + (b"data: [DONE]\n\n" if done else b"")


async def _collect(call: AgentCall, raw: bytes, seed: int) -> list[dict]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(raw)), 25))
    parts = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)])]

    async def chunks():
        for p in parts:
            yield p

    out = b"".join([b async for b in call.events(chunks())])
    events = []
    for block in out.decode().split("\n\n"):
        if block:
            name, data = block.split("\n")
            assert name == "event: " + json.loads(data[6:])["type"]
            events.append(json.loads(data[6:]))
    return events


def test_events_survive_any_split_of_the_chat_stream_and_store_the_answer():
    store = ResponseStore()
    raw = sse_bytes(chat_chunks())
    runs = []
    for seed in range(3):
        call = responses_call(json.dumps({"input": "hi", "stream": True}).encode(), store)
        runs.append(asyncio.run(_collect(call, raw, seed)))
    assert len({tuple(e["type"] for e in r) for r in runs}) == 1
    final = runs[-1][-1]["response"]
    assert store.get(final["id"]).response == final
    assert store.get(final["id"]).messages[-1]["tool_calls"][0]["id"] == "c1"
    status, body = stored(store, final["id"])
    assert status == 200 and json.loads(body) == final


def test_a_stream_that_errs_or_breaks_ends_failed_and_is_not_stored():
    store = ResponseStore()
    error = {"error": {"message": "KV transfer failed", "type": "server_error", "code": 503}}
    for raw in (sse_bytes(chat_chunks()[:3] + [error]), sse_bytes(chat_chunks()[:3], done=False)):
        call = responses_call(b'{"input": "hi", "stream": true}', store)
        events = asyncio.run(_collect(call, raw, 0))
        assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
        assert events[-1]["response"]["status"] == "failed"
    assert len(store) == 0


def test_previous_response_id_continues_the_stored_conversation():
    store = ResponseStore()
    call = responses_call(b'{"input": "q1", "instructions": "sys"}', store)
    status, body = call.answer(200, json.dumps(chat_answer(calls=())).encode())
    first = json.loads(body)
    nxt = responses_call(json.dumps({"input": "q2", "previous_response_id": first["id"]}).encode(), store)
    assert nxt.chat["messages"] == [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "text", "reasoning_content": "why"},
        {"role": "user", "content": "q2"},
    ]
    with pytest.raises(APIError) as e:
        responses_call(b'{"input": "q", "previous_response_id": "resp_gone"}', store)
    assert (e.value.status, e.value.code) == (400, "previous_response_not_found")
    unstored = responses_call(b'{"input": "q", "store": false}', store)
    unstored.answer(200, json.dumps(chat_answer(calls=())).encode())
    assert len(store) == 1
    assert stored(store, first["id"], delete=True)[0] == 200
    assert stored(store, first["id"])[0] == 404
    # a chat error passes as it is: it is OpenAI-shaped already
    assert responses_call(b'{"input": "q"}', store).answer(400, b'{"error": {}}') == (400, b'{"error": {}}')


def test_the_store_is_bounded_least_recently_used_first():
    s = ResponseStore(max_items=2, max_bytes=10_000)
    for i in range(3):
        s.put({"id": f"r{i}"}, [])
        if i == 1:
            s.get("r0")  # used: r1 is now the oldest
    assert s.get("r0") and s.get("r2") and s.get("r1") is None
    s.put({"id": "big", "pad": "x" * 6000}, [])
    s.put({"id": "big2", "pad": "x" * 6000}, [])  # the bytes bound drops every older one it must
    assert s.get("big2") and s.get("big") is None and s.bytes <= 10_000
    s.put({"id": "huge", "pad": "x" * 20_000}, [])
    assert s.get("huge") is None
    assert RESPONSES == "responses"


def test_a_stored_response_is_its_api_keys_alone():
    store = ResponseStore()
    call = responses_call(b'{"input": "secret plans"}', store, owner="alice")
    rid = json.loads(call.answer(200, json.dumps(chat_answer(calls=())).encode())[1])["id"]
    for other in ("bob", ""):
        assert stored(store, rid, other)[0] == 404
        assert stored(store, rid, other, delete=True)[0] == 404
        with pytest.raises(APIError):
            responses_call(json.dumps({"input": "and?", "previous_response_id": rid}).encode(), store, owner=other)
    assert stored(store, rid, "alice")[0] == 200
    assert responses_call(json.dumps({"input": "and?", "previous_response_id": rid}).encode(), store, "alice").chat
