"""The agent harnesses' APIs through the router over a real prefill/decode pair (NIXL) on the
v4-tiny checkpoint (DSML tool calls, V4 thinking), with the official clients: the Responses
function-call loop over `previous_response_id` (stored in the router's memory), streamed and not,
reasoning items, and Anthropic `tool_use` / thinking blocks, streamed and not — each equal to the
monolithic engine's answer (greedy). The same on a mono engine and a router in front of it:
tests/integration/test_agent_apis_http.py."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from test_pd import PDCluster

PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": PARAMS}]
ATOOLS = [{"name": "get_weather", "description": "Weather of a city", "input_schema": PARAMS}]
FORCED = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_output_tokens=140, temperature=0)


@pytest.fixture(scope="module")
def cluster(make_model, tmp_path_factory):
    c = PDCluster(make_model("v4-tiny"), tmp_path_factory.mktemp("pd-agent-apis"))
    yield c
    c.stop()


def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=300, max_retries=0)


def calls(r) -> list[tuple[str, str]]:
    return [(o.name, o.arguments) for o in r.output if o.type == "function_call"]


def loop(url: str, stream: bool) -> list[list[tuple[str, str]]]:
    """Two rounds of the Agents SDK's loop (the tiny context holds no more); the calls of each."""
    client, out, prev, items = oai(url), [], None, "Weather in Paris?"
    for i in range(2):
        kw = dict(model="m", input=items, previous_response_id=prev, instructions="Use the tool.", **FORCED)
        if stream:
            events = list(client.responses.create(**kw, stream=True))
            assert events[-1].type == "response.completed"
            r = events[-1].response
            args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
            assert args == calls(r)[0][1]
        else:
            r = client.responses.create(**kw)
        assert r.status == "completed" and len(calls(r)) == 1
        jsonschema.validate(json.loads(calls(r)[0][1]), PARAMS)
        out.append(calls(r))
        call_id = next(o.call_id for o in r.output if o.type == "function_call")
        prev, items = r.id, [{"type": "function_call_output", "call_id": call_id, "output": f"sunny, {20 + i} C"}]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_responses_loop_through_pd_equals_mono(cluster, stream):
    assert loop(cluster.r_url, stream) == loop(cluster.m_url, stream)


@pytest.mark.slow
def test_reasoning_items_and_thinking_blocks_through_pd_equal_mono(cluster):
    body = dict(model="m", input="Think first.", reasoning={"effort": "high"}, max_output_tokens=24, temperature=0)
    got = {}
    for where, url in (("pd", cluster.r_url), ("mono", cluster.m_url)):
        whole = oai(url).responses.create(**body)
        events = list(oai(url).responses.create(**body, stream=True))
        assert whole.output[0].type == "reasoning" and whole.status == "incomplete"
        text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert events[-1].type == "response.incomplete"
        assert text == whole.output[0].content[0].text == events[-1].response.output[0].content[0].text
        client = anthropic.Anthropic(base_url=url, api_key="none", timeout=300, max_retries=0)
        kw = dict(model="m", max_tokens=250, messages=[{"role": "user", "content": "Weather?"}], tools=ATOOLS,
                  tool_choice={"type": "any", "disable_parallel_tool_use": True},
                  thinking={"type": "enabled", "budget_tokens": 100}, extra_body={"temperature": 0})  # fmt: skip
        m = client.messages.create(**kw)
        with client.messages.stream(**kw) as s:
            streamed = s.get_final_message()
        strip = lambda msg: [{k: v for k, v in b.model_dump().items() if k != "id"} for b in msg.content]
        assert strip(m) == strip(streamed) and m.stop_reason == streamed.stop_reason
        assert m.content[0].type == "thinking"
        got[where] = (text, strip(m))
    assert got["pd"] == got["mono"]


@pytest.mark.slow
def test_count_tokens_through_pd_is_the_prompt_mono_gets(cluster):
    """The router has an engine of the PD pair count; the V4 prompt with tools and thinking on its
    0731 high tier counts what the request's usage says."""
    kw = dict(model="m", system="Use the tool.", messages=[{"role": "user", "content": "Weather?"}], tools=ATOOLS,
              thinking={"type": "adaptive"}, output_config={"effort": "high"})  # fmt: skip
    counts = []
    for url in (cluster.r_url, cluster.m_url):
        client = anthropic.Anthropic(base_url=url, api_key="none", timeout=300, max_retries=0)
        counts.append(client.messages.count_tokens(**kw).input_tokens)
        m = client.messages.create(**kw, max_tokens=8, extra_body={"temperature": 0})
        assert counts[-1] == m.usage.input_tokens + m.usage.cache_read_input_tokens
    low = client.messages.count_tokens(**{**kw, "output_config": {"effort": "low"}})
    assert counts[0] == counts[1] > low.input_tokens  # the high tier's effort prompt is counted
