"""Agent frameworks' own tool-call loops against a dsv4 server: one framework per run, run by
`dsv4 bench frameworks` in the interpreter that has the frameworks installed (they are no
dependency of dsv4: this file imports only the standard library and the framework it drives).

    python framework_loops.py FRAMEWORK --base-url URL/v1 --model NAME --rounds R [--stream] [--bias JSON]

FRAMEWORK: `agents-sdk` (the OpenAI Agents SDK's Runner over the Responses API, its default
model class), `instructor` (TOOLS mode, a nested pydantic model: `$defs`, `$ref`, an enum, an
optional field), `langchain` (ChatOpenAI.bind_tools over several rounds with ToolMessages).
Each sends `tool_choice` as the framework does (`auto` for the Agents SDK and LangChain;
instructor's TOOLS mode names its function). `--bias`: a logit bias toward the tokens that
open a call (random weights rarely call on their own), sent the framework's way for extra body
fields. Prints one JSON object: rounds, calls made and parsed, malformed (a call the framework
could not parse or validate), cut (an answer max_tokens ended before a call completed: nothing
lost, nothing invented), errors (anything else that ended a round), the framework's version.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from importlib.metadata import version

CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
    "required": ["city"],
    "additionalProperties": False,
}


def agents_sdk(a: argparse.Namespace) -> dict:
    from agents import Agent, FunctionTool, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled
    from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # the SDK's traces would go to OpenAI's servers
    calls: list[str] = []

    async def get_weather(ctx, arguments: str) -> str:
        city = json.loads(arguments)["city"]  # the SDK validated the arguments against the schema
        calls.append(city)
        return f"sunny in {city}"

    # the schema given whole (a bounded city: random weights write strings until max_tokens)
    tool = FunctionTool(
        name="get_weather",
        description="Weather of a city.",
        params_json_schema=CITY_SCHEMA,
        on_invoke_tool=get_weather,
        strict_json_schema=True,
    )

    client = AsyncOpenAI(base_url=a.base_url, api_key="bench", max_retries=0, timeout=300)
    settings = ModelSettings(tool_choice="auto", max_tokens=a.max_tokens, temperature=0, extra_body=a.extra)
    agent = Agent(
        name="weather",
        instructions="Use the tool.",
        tools=[tool],
        model=OpenAIResponsesModel(model=a.model, openai_client=client),
        model_settings=settings,
    )
    out = {"rounds": 0, "calls": 0, "malformed": 0, "cut": 0, "errors": []}

    async def run() -> None:
        for i in range(a.rounds):
            before = len(calls)
            try:
                if a.stream:
                    result = Runner.run_streamed(agent, f"Weather in city {i}?", max_turns=2)
                    async for _ in result.stream_events():
                        pass
                else:
                    await Runner.run(agent, f"Weather in city {i}?", max_turns=2)
            except MaxTurnsExceeded:
                pass  # the model kept calling: every call was made, the loop was only cut
            except ModelBehaviorError as e:
                if "max_output_tokens" in str(e):  # the answer was cut (response.incomplete): no call lost
                    out["cut"] += 1
                else:  # a call the SDK could not parse or dispatch
                    out["malformed"] += 1
                    out["errors"].append(f"{type(e).__name__}: {e}"[:300])
            except Exception as e:
                out["errors"].append(f"{type(e).__name__}: {e}"[:300])
            out["rounds"] += 1
            out["calls"] += len(calls) - before

    asyncio.run(run())
    return out


def instructor_loop(a: argparse.Namespace) -> dict:
    from typing import Literal, Optional

    import instructor
    from instructor.core.exceptions import IncompleteOutputException, InstructorRetryException
    from openai import OpenAI
    from pydantic import BaseModel, Field, ValidationError

    class Place(BaseModel):
        city: str = Field(pattern="^[a-z]{1,8}$")
        country: Optional[str] = Field(default=None, pattern="^[a-z]{1,8}$")

    class Forecast(BaseModel):
        place: Place
        unit: Literal["c", "f"]  # an enum in the schema (an Enum class fails instructor 1.17's partial stream)
        days: int = Field(ge=1, le=7)

    client = instructor.from_openai(
        OpenAI(base_url=a.base_url, api_key="bench", max_retries=0, timeout=300), mode=instructor.Mode.TOOLS
    )
    out = {"rounds": 0, "calls": 0, "malformed": 0, "cut": 0, "errors": []}
    for i in range(a.rounds):
        msgs = [{"role": "user", "content": f"Forecast for city {i}, 3 days, in c."}]
        kw = dict(model=a.model, messages=msgs, max_tokens=a.max_tokens, temperature=0, max_retries=0)
        try:
            if a.stream:
                last = None
                for partial in client.chat.completions.create_partial(response_model=Forecast, **kw):
                    last = partial
                Forecast.model_validate(last.model_dump())  # the partial stream ends whole
            else:
                client.chat.completions.create(response_model=Forecast, **kw)
            out["calls"] += 1
        except IncompleteOutputException:  # max_tokens cut the call: instructor says so
            out["cut"] += 1
        except (InstructorRetryException, ValidationError) as e:
            out["malformed"] += 1
            out["errors"].append(f"{type(e).__name__}: {e}"[:300])
        except Exception as e:
            out["errors"].append(f"{type(e).__name__}: {e}"[:300])
        out["rounds"] += 1
    return out


def langchain_loop(a: argparse.Namespace) -> dict:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    tool = {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather of a city", "parameters": CITY_SCHEMA},
    }
    llm = ChatOpenAI(
        model=a.model,
        base_url=a.base_url,
        api_key="bench",
        max_retries=0,
        timeout=300,
        temperature=0,
        max_tokens=a.max_tokens,
        extra_body=a.extra or None,
    ).bind_tools([tool], tool_choice="auto")
    msgs: list = [SystemMessage("Use the tool."), HumanMessage("Weather in Paris?")]
    out = {"rounds": 0, "calls": 0, "malformed": 0, "cut": 0, "errors": []}
    for _ in range(a.rounds):
        try:
            if a.stream:
                reply = None
                for chunk in llm.stream(msgs):
                    reply = chunk if reply is None else reply + chunk
                reply = AIMessage(
                    content=reply.content,
                    tool_calls=reply.tool_calls,
                    invalid_tool_calls=reply.invalid_tool_calls,
                    response_metadata=reply.response_metadata,
                )
            else:
                reply = llm.invoke(msgs)
        except Exception as e:
            out["errors"].append(f"{type(e).__name__}: {e}"[:300])
            out["rounds"] += 1
            continue
        out["rounds"] += 1
        if not reply.tool_calls and (reply.response_metadata or {}).get("finish_reason") == "length":
            out["cut"] += 1
        out["malformed"] += len(reply.invalid_tool_calls)
        out["calls"] += len(reply.tool_calls)
        msgs.append(reply)
        if reply.tool_calls:
            msgs += [ToolMessage(f"sunny in {c['args'].get('city')}", tool_call_id=c["id"]) for c in reply.tool_calls]
        else:
            msgs.append(HumanMessage("And the next city?"))
    return out


LOOPS = {
    "agents-sdk": (agents_sdk, "openai-agents"),
    "instructor": (instructor_loop, "instructor"),
    "langchain": (langchain_loop, "langchain-openai"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("framework", choices=sorted(LOOPS))
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--bias", default="{}", help="logit bias (JSON) toward the call-opening tokens")
    a = p.parse_args()
    bias = json.loads(a.bias)
    a.extra = {"logit_bias": bias} if bias else {}
    loop, dist = LOOPS[a.framework]
    t0 = time.monotonic()
    out = loop(a)
    out.update(framework=a.framework, version=version(dist), stream=a.stream, wall_s=round(time.monotonic() - t0, 2))
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
