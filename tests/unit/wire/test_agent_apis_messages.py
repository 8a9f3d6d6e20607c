"""Anthropic's Messages API as a translation onto chat completions (dsv4_wire.agent_apis),
without I/O: requests to chat bodies, chat answers and streams to messages and their events,
errors in Anthropic's shape, and x-api-key at the key gate. The real servers:
tests/integration/test_agent_apis_http.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from dsv4_wire import APIError
from dsv4_wire.agent_apis.edge import messages_call, refusal
from dsv4_wire.agent_apis.messages_output import MessagesStream, error_from_openai, message_from_chat
from dsv4_wire.agent_apis.messages_request import messages_to_chat
from dsv4_wire.api_keys import ApiKey, ApiKeyGate, KeyRing

SCHEMA = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}
USER = [{"role": "user", "content": "x"}]


def test_a_claude_code_style_request_as_chat():
    body = {
        "model": "m",
        "max_tokens": 300,
        "system": [
            {"type": "text", "text": "You are a CLI.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Be brief."},
        ],
        "messages": [
            {"role": "user", "content": "list files"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "use ls", "signature": ""},
                    {"type": "text", "text": "Running ls."},
                    {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"cmd": "ls"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "bash", "input": {"cmd": "pwd"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [{"type": "text", "text": "/w"}],
                        "is_error": False,
                    },
                    {"type": "text", "text": "now?", "cache_control": {"type": "ephemeral"}},
                ],
            },
        ],
        "tools": [
            {"name": "bash", "description": "run", "input_schema": SCHEMA, "cache_control": {"type": "ephemeral"}}
        ],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 200},
        "stop_sequences": ["END"],
        "temperature": 0,
        "top_k": 5,
        "metadata": {"user_id": "u"},
        "stream": True,
    }
    assert messages_to_chat(body).chat == {
        "messages": [
            {"role": "system", "content": "You are a CLI.\n\nBe brief."},
            {"role": "user", "content": "list files"},
            {
                "role": "assistant",
                "content": "Running ls.",
                "reasoning_content": "use ls",
                "tool_calls": [
                    {"id": "toolu_1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}},
                    {"id": "toolu_2", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "pwd"}'}},
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "a.txt"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "/w"},
            {"role": "user", "content": "now?"},
        ],
        "max_tokens": 300,
        "model": "m",
        "temperature": 0,
        "top_k": 5,
        "stop": ["END"],
        "tools": [{"type": "function", "function": {"name": "bash", "parameters": SCHEMA, "description": "run"}}],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "chat_template_kwargs": {"thinking": True},
        "reasoning_effort": "low",  # a budget of 200 tokens
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@pytest.mark.parametrize(
    "choice, expected",
    [
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "bash"}, {"type": "function", "function": {"name": "bash"}}),
    ],
)
def test_tool_choices(choice, expected):
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": choice}
    assert messages_to_chat(body).chat["tool_choice"] == expected


def test_output_config_and_adaptive_thinking():
    body = {
        "max_tokens": 5,
        "messages": USER,
        "thinking": {"type": "adaptive"},
        "output_config": {"effort": "high", "format": {"type": "json_schema", "schema": SCHEMA}},
        "cache_control": {"type": "ephemeral"},
        "speed": "standard",
        # what Claude Code 2.1 sends with every request: keep all thinking, i.e. change nothing
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    }
    chat = messages_to_chat(body).chat
    assert chat["chat_template_kwargs"] == {"thinking": True} and chat["reasoning_effort"] == "high"
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": SCHEMA}}


def test_a_system_message_mid_conversation_stays_where_it_is():
    body = {
        "max_tokens": 5,
        "messages": [*USER, {"role": "system", "content": [{"type": "text", "text": "agents: ..."}]}],
    }
    assert messages_to_chat(body).chat["messages"] == [*USER, {"role": "system", "content": "agents: ..."}]


def test_thinking_disabled_and_a_results_only_turn():
    body = {
        "max_tokens": 5,
        "thinking": {"type": "disabled"},
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
        ],
    }
    chat = messages_to_chat(body).chat
    assert chat["chat_template_kwargs"] == {"thinking": False}
    assert chat["messages"][-1] == {"role": "tool", "tool_call_id": "t", "content": ""}


@pytest.mark.parametrize(
    "change, names",
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
        ({"messages": [*USER, {"role": "assistant", "content": "Sure,"}]}, "prefill"),
        (
            {
                "messages": [
                    *USER,
                    {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},
                    *USER,
                ]
            },
            "redacted_thinking",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "role"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
        ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "budget_tokens"),
        ({"mcp_servers": [{"url": "x"}]}, "mcp_servers"),
        ({"diagnostics": {"previous_message_id": None}}, "diagnostics"),
        ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, "context_management.edits[0]"),
        (
            {
                "context_management": {
                    "edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}}]
                }
            },
            "context_management",
        ),
        ({"speed": "fast"}, "speed"),
        ({"thinking": {"type": "between_tools"}}, "between_tools"),
        ({"thinking": {"type": "adaptive", "display": "omitted"}}, "omitted"),
        ({"thinking": {"type": "enabled", "budget_tokens": 10, "display": "omitted"}}, "omitted"),
        ({"tools": [{"name": "b", "input_schema": SCHEMA, "defer_loading": True}]}, "tools[0].defer_loading"),
        (
            {"tools": [{"name": "b", "input_schema": SCHEMA, "allowed_callers": ["code_execution_20250825"]}]},
            "allowed_callers",
        ),
        ({"tools": [{"name": "b", "input_schema": SCHEMA, "input_examples": [{"cmd": "ls"}]}]}, "input_examples"),
        ({"output_config": {"format": {"type": "regex"}}}, "output_config.format"),
        ({"output_config": {"task_budget": 5}}, "task_budget"),
        ({"system": [{"type": "image"}]}, "system"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "tool_result", "tool_use_id": "t"}],
                    }
                ]
            },
            "tool_result",
        ),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(change, names):
    body = {"max_tokens": 50, "messages": USER, **change}
    with pytest.raises(APIError) as e:
        messages_to_chat(body)
    assert e.value.status == 400 and names in e.value.message
    status, raw = refusal("messages", e.value)
    assert status == 400 and json.loads(raw) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": e.value.message},
    }


def chat_answer(finish="tool_calls"):
    return {
        "model": "m",
        "choices": [
            {
                "finish_reason": finish,
                "message": {
                    "content": "ok",
                    "reasoning_content": "hm",
                    "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}
                    ],
                },
            }
        ],
        "usage": {
            "prompt_tokens": 10,
            "completion_tokens": 3,
            "total_tokens": 13,
            "prompt_tokens_details": {"cached_tokens": 8},
        },
    }


def test_a_chat_answer_as_a_message():
    m = message_from_chat(chat_answer(), "msg_1")
    assert m == {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [
            {"type": "thinking", "thinking": "hm", "signature": ""},
            {"type": "text", "text": "ok"},
            {"type": "tool_use", "id": "call_1", "name": "bash", "input": {"cmd": "ls"}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 2,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 8,
            "output_tokens": 3,
        },
    }
    assert message_from_chat(chat_answer("length"), "m")["stop_reason"] == "max_tokens"
    assert message_from_chat(chat_answer("stop"), "m")["stop_reason"] == "end_turn"


def chunks():
    def ch(delta=None, finish=None):
        return {"model": "m", "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}

    return [
        ch({"role": "assistant", "content": ""}),
        ch({"reasoning_content": "h"}),
        ch({"reasoning_content": "m"}),
        ch({"content": "ok"}),
        ch(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "bash", "arguments": '{"cmd": '},
                    }
                ]
            }
        ),
        ch({"tool_calls": [{"index": 0, "function": {"arguments": '"ls"}'}}]}),
        ch(
            {
                "tool_calls": [
                    {"index": 1, "id": "call_2", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
                ]
            }
        ),
        ch({}, "tool_calls"),
        {"model": "m", "choices": [], "usage": chat_answer()["usage"]},
    ]


def test_a_chat_stream_as_anthropic_events():
    s = MessagesStream("msg_1", "m")
    events = [e for c in chunks() for e in s.feed(c)] + s.finish()
    assert [(e["type"], e.get("index")) for e in events] == [
        ("message_start", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
        ("content_block_delta", 2),
        ("content_block_stop", 2),
        ("content_block_start", 3),
        ("content_block_delta", 3),
        ("content_block_stop", 3),
        ("message_delta", None),
        ("message_stop", None),
    ]
    assert events[8]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "bash", "input": {}}
    partial = "".join(
        e["delta"]["partial_json"] for e in events if e.get("index") == 2 and e["type"] == "content_block_delta"
    )
    assert json.loads(partial) == {"cmd": "ls"}
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == 3 and events[-2]["usage"]["cache_read_input_tokens"] == 8


def test_stream_errors_and_chat_errors_in_anthropic_shape():
    async def run(raw: bytes) -> str:
        async def gen():
            yield raw

        call = messages_call(b'{"max_tokens": 5, "stream": true, "messages": [{"role": "user", "content": "x"}]}')
        return b"".join([b async for b in call.events(gen())]).decode()

    err = b'data: {"error": {"message": "boom", "type": "server_error", "code": 503}}\n\ndata: [DONE]\n\n'
    out = asyncio.run(run(err))
    assert out == 'event: error\ndata: {"type": "error", "error": {"type": "overloaded_error", "message": "boom"}}\n\n'
    call = messages_call(b'{"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}')
    status, raw = call.answer(429, json.dumps(APIError("slow down", 429).body()).encode())
    assert (status, json.loads(raw)) == (
        429,
        {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}},
    )
    assert error_from_openai(500, b"not json")["error"] == {"type": "api_error", "message": "not json"}


def test_x_api_key_is_a_key_and_messages_refusals_are_anthropic_shaped():
    ring = KeyRing([ApiKey("alice", "sk-a")])
    assert ring.identify({"x-api-key": "sk-a"}).name == "alice"
    assert ring.identify({"x-api-key": "sk-b"}) is None

    async def call(path: str, headers: list) -> tuple[int, dict]:
        sent = []

        async def app(scope, receive, send):
            raise AssertionError("a refused request reaches no app")

        async def send(msg):
            sent.append(msg)

        scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
        await ApiKeyGate(app, ring)(scope, None, send)
        return sent[0]["status"], json.loads(sent[1]["body"])

    status, body = asyncio.run(call("/v1/messages", [(b"x-api-key", b"wrong")]))
    assert status == 401 and body["type"] == "error" and body["error"]["type"] == "authentication_error"
    status, body = asyncio.run(call("/v1/responses", []))
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


def test_the_doors_answer_messages_in_anthropic_shape():
    """The router's per-key limit (429) and a draining engine (503) refuse /v1/messages in
    Anthropic's shape and the chat route in OpenAI's, and count the agent routes as generation."""
    from prometheus_client import CollectorRegistry

    from dsv4_router.tenancy import KeyLimiter, TenantGate, TenantLimits, TenantMetrics
    from dsv4_serve.gate import Gate, Lifecycle

    async def app(scope, receive, send):
        raise AssertionError("a refused request reaches no app")

    async def call(door, path: str) -> tuple[int, dict]:
        sent = []

        async def send(msg):
            sent.append(msg)

        await door({"type": "http", "method": "POST", "path": path, "headers": []}, None, send)
        return sent[0]["status"], json.loads(sent[1]["body"])

    limiter = KeyLimiter(TenantLimits(rate=0.5, burst=1))
    tenants = TenantGate(app, limiter, TenantMetrics(CollectorRegistry()), clock=lambda: 0.0)
    limiter.admit("anonymous", 0.0)  # the bucket is empty now
    for door, status in ((tenants, 429), (Gate(app, Lifecycle(draining=True)), 503)):
        got, body = asyncio.run(call(door, "/v1/messages"))
        assert (
            got == status
            and body["type"] == "error"
            and body["error"]["type"] in ("rate_limit_error", "overloaded_error")
        )
        got, body = asyncio.run(call(door, "/v1/responses"))
        assert got == status and "message" in body["error"]


def test_count_tokens_translates_the_prompt_as_the_request_does():
    from dsv4_wire.agent_apis.edge import count_tokens_chat

    tools = [{"name": "bash", "input_schema": SCHEMA}]
    prompt = {"model": "m", "system": "s", "messages": USER, "tools": tools, "thinking": {"type": "adaptive"}}
    real = messages_call({**prompt, "max_tokens": 9, "temperature": 0.5, "stream": True}).chat
    counted = count_tokens_chat(prompt)  # no max_tokens needed
    assert counted == {
        k: v for k, v in real.items() if k not in ("max_tokens", "temperature", "stream", "stream_options")
    }
    assert count_tokens_chat({**prompt, "max_tokens": 9, "stop_sequences": ["x"]}) == counted
    with pytest.raises(APIError) as e:
        count_tokens_chat({"model": "m", "messages": [{"role": "user", "content": [{"type": "document"}]}]})
    assert e.value.status == 400 and "document" in e.value.message


@pytest.mark.parametrize(
    "budget, effort", [(1, "low"), (2047, "low"), (2048, "medium"), (8192, "high"), (31999, "high"), (32768, "max")]
)
def test_a_thinking_budget_is_an_effort_tier(budget, effort):
    chat = messages_to_chat(
        {"max_tokens": 10**6, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": budget}}
    ).chat
    assert chat["chat_template_kwargs"] == {"thinking": True} and chat["reasoning_effort"] == effort
    given = {"type": "enabled", "budget_tokens": budget}
    chat = messages_to_chat(
        {"max_tokens": 10**6, "messages": USER, "thinking": given, "output_config": {"effort": "max"}}
    ).chat
    assert chat["reasoning_effort"] == "max"  # the effort asked for wins over the budget's
    chat = messages_to_chat({"max_tokens": 10, "messages": USER, "thinking": {"type": "adaptive"}}).chat
    assert "reasoning_effort" not in chat  # the checkpoint's default tier
