"""The agent harnesses' APIs through their official clients against real processes: OpenAI's
Responses API (`openai` client: `responses.create`, streamed and not, a function-call loop over
`previous_response_id`, stored responses fetched and deleted) and Anthropic's Messages API
(`anthropic` client: `tool_use` / `tool_result` rounds, streamed and not, errors in Anthropic's
shape, `x-api-key`), on a monolithic engine and through a router in front of it (with API keys)
on the tiny checkpoint (V3.1 tool-call format). The router over a real prefill/decode pair:
tests/integration/test_agent_apis_pd.py.

Calls are forced, one a turn (`tool_choice: "required"` / `{"type": "any"}` without parallel
calls: the grammar makes even random weights call) and greedy, so every round is a call and mono
and router answer alike."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from bench.harness.commands import Proc, free_port, serving

KEY = "sk-agents"
PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": PARAMS}]
ATOOLS = [{"name": "get_weather", "description": "Weather of a city", "input_schema": PARAMS}]


@pytest.fixture(scope="module")
def urls(make_model, tmp_path_factory):
    """{"mono": engine URL, "router": a router in front of it, which wants API keys}."""
    tmp = tmp_path_factory.mktemp("agent-apis")
    args = ["--model", make_model("tiny"), "--kv-memory-gb", 0.05, "--max-num-seqs", 8, "--served-model-name", "m"]
    with serving(args, tmp / "engine.log") as mono:
        port = free_port()
        router = Proc(
            ["router", "--mono", mono, "--port", port, "--api-key", KEY, "--health-interval", "0.5"], tmp / "router.log"
        )
        try:
            router.wait_ready(f"http://127.0.0.1:{port}")
            yield {"mono": mono, "router": f"http://127.0.0.1:{port}"}
        finally:
            router.stop()


def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=120, max_retries=0)


def claude(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=KEY, timeout=120, max_retries=0)


def calls_of(response) -> list:
    return [o for o in response.output if o.type == "function_call"]


def responses_loop(client: openai.OpenAI, rounds: int = 3) -> list:
    """The Agents SDK's loop over previous_response_id: each round answers the last round's call."""
    out = []
    r = client.responses.create(
        model="m", input="Weather in Paris?", instructions="Use the tool.", tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=80, temperature=0,
    )  # fmt: skip
    out.append(r)
    for i in range(rounds - 1):
        (call,) = calls_of(r)
        r = client.responses.create(
            model="m",
            previous_response_id=r.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": f"sunny, {20 + i} C"}],
            instructions="Use the tool.",
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=80,
            temperature=0,
        )
        out.append(r)
    return out


@pytest.mark.parametrize("where", ["mono", "router"])
def test_responses_function_call_loop_over_previous_response_id(urls, where):
    rounds = responses_loop(oai(urls[where]))
    for r in rounds:
        assert r.status == "completed" and r.object == "response"
        (call,) = calls_of(r)
        assert call.name == "get_weather" and call.call_id
        jsonschema.validate(json.loads(call.arguments), PARAMS)
    # each round's prompt is the last one grown by its answer and the tool's output
    inputs = [r.usage.input_tokens for r in rounds]
    assert inputs == sorted(inputs) and len(set(inputs)) == len(inputs)
    assert rounds[-1].usage.input_tokens_details.cached_tokens > 0
    got = oai(urls[where]).responses.retrieve(rounds[0].id)
    assert got.id == rounds[0].id and calls_of(got)[0].arguments == calls_of(rounds[0])[0].arguments
    oai(urls[where]).responses.delete(rounds[0].id)
    with pytest.raises(openai.NotFoundError):
        oai(urls[where]).responses.retrieve(rounds[0].id)
    with pytest.raises(openai.BadRequestError) as e:
        oai(urls[where]).responses.create(model="m", input="x", previous_response_id=rounds[0].id)
    assert e.value.body["code"] == "previous_response_not_found"


def test_responses_mono_and_router_agree_and_stream_what_they_answer(urls):
    answers = []
    for where in ("mono", "router"):
        body = dict(model="m", input="Weather in Paris?", instructions="Use the tool.", tools=TOOLS,
                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=80, temperature=0)  # fmt: skip
        whole = oai(urls[where]).responses.create(**body)
        events = list(oai(urls[where]).responses.create(**body, stream=True))
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        final = events[-1].response
        assert args == calls_of(final)[0].arguments == calls_of(whole)[0].arguments
        assert final.usage.output_tokens == whole.usage.output_tokens
        with oai(urls[where]).responses.stream(**body) as s:  # the client's own accumulator
            assert calls_of(s.get_final_response())[0].arguments == args
        answers.append((calls_of(whole)[0].name, args))
    assert answers[0] == answers[1]


def test_responses_refuse_what_they_cannot_honour(urls):
    for where in ("mono", "router"):
        with pytest.raises(openai.BadRequestError) as e:
            oai(urls[where]).responses.create(model="m", input="x", tools=[{"type": "web_search"}])
        assert "web_search" in e.value.message
        with pytest.raises(openai.BadRequestError) as e:
            oai(urls[where]).responses.create(model="m", input="x", max_output_tokens=10**9)
        assert "context length" in e.value.message  # the chat path's own checks


@pytest.mark.parametrize("where", ["mono", "router"])
def test_messages_tool_use_rounds_streamed_and_not(urls, where):
    client = claude(urls[where])
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    once = {"type": "any", "disable_parallel_tool_use": True}
    # temperature is no argument of this anthropic client's create(): it rides extra_body
    body = dict(model="m", max_tokens=80, system="Use the tool.", tools=ATOOLS, tool_choice=once,
                extra_body={"temperature": 0})  # fmt: skip
    inputs = []
    for i in range(2):
        m = client.messages.create(messages=msgs, **body)
        assert m.type == "message" and m.role == "assistant" and m.stop_reason == "tool_use"
        uses = [b for b in m.content if b.type == "tool_use"]
        assert uses and uses[0].name == "get_weather"
        jsonschema.validate(uses[0].input, PARAMS)
        inputs.append(m.usage.input_tokens + m.usage.cache_read_input_tokens)
        with client.messages.stream(messages=msgs, **body) as s:
            streamed = s.get_final_message()
        assert [b.model_dump() for b in streamed.content] == [
            b.model_dump() for b in m.content if b.type != "tool_use"
        ] + [dict(b.model_dump(), id=streamed.content[-1].id) for b in uses]
        assert streamed.stop_reason == "tool_use" and streamed.usage.output_tokens == m.usage.output_tokens
        msgs += [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": f"sunny, {20 + i} C"}],
            },
        ]
    assert inputs[1] > inputs[0]


def test_messages_errors_are_anthropic_shaped_and_keys_ride_x_api_key(urls):
    for where in ("mono", "router"):
        with pytest.raises(anthropic.BadRequestError) as e:
            claude(urls[where]).messages.create(
                model="m",
                max_tokens=10,
                messages=[
                    {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}
                ],
            )
        assert e.value.body == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": e.value.body["error"]["message"]},
        }
        assert "image" in e.value.body["error"]["message"]
    # the router wants a key: the anthropic client's x-api-key passes, a wrong one is Anthropic's 401
    bad = anthropic.Anthropic(base_url=urls["router"], api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(f"{urls['router']}/v1/messages", json={"messages": []}, headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"
    # the router counts them under the path the client called
    metrics = httpx.get(f"{urls['router']}/metrics", timeout=30).text
    assert 'dsv4_router:requests_total{endpoint="/v1/messages"}' in metrics


@pytest.mark.parametrize("where", ["mono", "router"])
def test_messages_count_tokens_is_the_prompt_the_request_has(urls, where):
    """`messages.count_tokens` counts the prompt `messages.create` gets: same translation, same
    template (tools, tool_choice, thinking, a tool round), the cache's share included."""
    client = claude(urls[where])
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}, {"type": "text", "text": "And Rome?"}]},
    ]  # fmt: skip
    prompt = dict(model="m", system="Use the tool.", messages=msgs, tools=ATOOLS, tool_choice={"type": "auto"})
    for thinking in ({"type": "disabled"}, {"type": "enabled", "budget_tokens": 1}):
        n = client.messages.count_tokens(**prompt, thinking=thinking).input_tokens
        m = client.messages.create(**prompt, thinking=thinking, max_tokens=2, extra_body={"temperature": 0})
        assert n == m.usage.input_tokens + m.usage.cache_read_input_tokens
    bare = client.messages.count_tokens(model="m", messages=msgs[:1]).input_tokens
    assert 0 < bare < n  # the tools prompt and the tool round are counted
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.count_tokens(model="m", messages=[{"role": "user", "content": [{"type": "image"}]}])
    assert e.value.body["type"] == "error" and "image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.count_tokens(model="other", messages=msgs[:1])
    assert e.value.body["error"]["type"] == "not_found_error"
