"""A Responses API request (`POST /v1/responses`) as a chat-completions body. Pure.

What the OpenAI Agents SDK sends is served: `input` as text or items (messages with text parts,
`function_call`, `function_call_output`, `reasoning`), `instructions`, function `tools`,
`tool_choice`, `parallel_tool_calls`, `max_output_tokens`, `temperature`, `top_p`,
`reasoning.effort`, `text.format` (text, json_object, json_schema), `store`,
`previous_response_id` (the caller resolves it to the earlier conversation), `metadata`,
`prompt_cache_key`. A field of the Responses API this server cannot honour (hosted tools,
images and files, background mode, conversations, reasoning summaries, ...) is a 400 naming
it; fields nobody defines are ignored, as on the chat route.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from dsv4_wire.errors import APIError

# Responses fields with no meaning here: a value other than the neutral one is refused.
NEUTRAL = {
    "background": (None, False),
    "conversation": (None,),
    "prompt": (None,),
    "max_tool_calls": (None,),
    "top_logprobs": (None, 0),
    "context_management": (None, []),
    "prompt_cache_retention": (None, "in_memory"),
    "moderation": (None,),
    "image": (None,),
    "access_programs": (None,),
    "background_options": (None,),
}
# Function-tool fields with no meaning here: a tool found by search, one run asynchronously or
# called from code, a description of its output (the model's format has no place for one).
TOOL_NEUTRAL = {
    "defer_loading": (None, False),
    "async": (None, False),
    "allowed_callers": (None,),
    "output_schema": (None,),
}
# reasoning fields: which turns' reasoning is kept is the model format's rule; one mode
REASONING_NEUTRAL = {"context": (None, "auto"), "mode": (None, "standard")}
# sampling extras the chat route serves (vLLM's), passed through as they are
CHAT_EXTRAS = (
    "top_k",
    "seed",
    "stop",
    "min_tokens",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
)


@dataclass
class ResponsesRequest:
    """What the answer echoes and what storing it needs, beside the chat body."""

    body: dict
    chat: dict
    messages: list  # the conversation sent (earlier rounds included), without the instructions
    stream: bool = False
    store: bool = True


def _bad(message: str, param: Optional[str] = None) -> APIError:
    return APIError(message, 400, "invalid_request_error", param=param)


def _text_of(content: Any, param: str, allowed: tuple[str, ...]) -> str:
    """The text of a message's content: a string, or text parts only."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{param} must be a string or a list of content parts", param)
    out = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed or not isinstance(part.get("text"), str):
            raise _bad(f"{param}[{i}]: content part type {kind!r} is not supported (only {', '.join(allowed)})", param)
        out.append(part["text"])
    return "".join(out)


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise _bad("tools must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise _bad(f"tools[{i}]: tool type {kind!r} is not supported (only function tools)", "tools")
        if not isinstance(t.get("name"), str):
            raise _bad(f"tools[{i}]: a function tool needs a name", "tools")
        for field, neutral in TOOL_NEUTRAL.items():
            if t.get(field) not in neutral:
                raise _bad(f"tools[{i}].{field} is not supported by this server", f"tools.{field}")
        fn = {"name": t["name"]}
        for k in ("description", "parameters", "strict"):
            if t.get(k) is not None:
                fn[k] = t[k]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad(f"tool_choice {choice!r} is not supported (auto, none, required or a function)", "tool_choice")


def _text_format(text: Any) -> Optional[dict]:
    """text.format as a chat response_format (None for plain text)."""
    if not isinstance(text, dict):
        raise _bad("text must be an object", "text")
    if text.get("verbosity") not in (None, "medium"):
        raise _bad("text.verbosity is not supported", "text.verbosity")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {"name": fmt.get("name") or "response", "schema": fmt.get("schema")}
        if fmt.get("strict") is not None:
            schema["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": schema}
    raise _bad(f"text.format type {kind!r} is not supported", "text.format")


class _Conversation:
    """Input items folded into chat messages: an assistant turn is its reasoning, text and calls."""

    def __init__(self, messages: list):
        self.messages = list(messages)
        self.reasoning: Optional[str] = None  # a reasoning item waiting for its assistant turn

    def _assistant(self) -> dict:
        last = self.messages[-1] if self.messages else None
        if last is not None and last["role"] == "assistant" and self.reasoning is None:
            return last
        msg = {"role": "assistant", "content": None}
        if self.reasoning is not None:
            msg["reasoning_content"], self.reasoning = self.reasoning, None
        self.messages.append(msg)
        return msg

    def add(self, item: Any, i: int) -> None:
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}: role {role!r} is not supported", "input")
            if role == "assistant":
                text = _text_of(item.get("content"), where, ("output_text", "input_text", "refusal", "text"))
                msg = self._assistant()
                if msg.get("tool_calls"):  # text after calls starts a new turn
                    self.messages.append(msg := {"role": "assistant", "content": None})
                msg["content"] = (msg["content"] or "") + text
                return
            self.drop_unanswered_reasoning()
            text = _text_of(item.get("content"), where, ("input_text", "text"))
            self.messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise _bad(f"{where}: a function_call needs name and call_id", "input")
            args = item.get("arguments", "")
            if not isinstance(args, str):
                raise _bad(f"{where}: function_call arguments must be a string", "input")
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": args}}
            self._assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _bad(f"{where}: a function_call_output needs call_id", "input")
            self.drop_unanswered_reasoning()
            out = _text_of(item.get("output"), where, ("input_text", "output_text", "text"))
            self.messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": out})
        elif kind == "reasoning":
            parts = item.get("content") or []
            if not isinstance(parts, list):
                raise _bad(f"{where}: reasoning content must be a list", "input")
            text = _text_of(parts, where, ("reasoning_text",))
            if not text and item.get("encrypted_content"):
                raise _bad(f"{where}: encrypted reasoning is not supported", "input")
            self.reasoning = (self.reasoning or "") + text
        else:
            raise _bad(f"{where}: input item type {kind!r} is not supported", "input")

    def drop_unanswered_reasoning(self) -> None:
        """Reasoning with no assistant turn after it has nothing to be rendered with."""
        self.reasoning = None


def responses_to_chat(body: Any, history: Optional[list] = None) -> ResponsesRequest:
    """The chat body of a Responses request; `history`: the chat messages of the response named
    by `previous_response_id` (its conversation, its answer included)."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    for name, allowed in NEUTRAL.items():
        if body.get(name) not in allowed:
            raise _bad(f"{name} is not supported by this server", name)
    if "input" not in body:
        raise _bad("input is required", "input")
    if body.get("truncation") not in (None, "disabled"):
        raise _bad('truncation "auto" is not supported: a prompt beyond the context is refused', "truncation")
    include = body.get("include") or []
    if not isinstance(include, list) or include:
        raise _bad(f"include {include!r} is not supported", "include")
    if body.get("service_tier") not in (None, "auto", "default"):
        raise _bad(f"service_tier {body['service_tier']!r} is not supported", "service_tier")
    conv = _Conversation(history or [])
    inp = body["input"]
    if isinstance(inp, str):
        conv.add({"role": "user", "content": inp}, 0)
    elif isinstance(inp, list):
        for i, item in enumerate(inp):
            conv.add(item, i)
    else:
        raise _bad("input must be a string or a list of items", "input")
    conv.drop_unanswered_reasoning()
    if not conv.messages:
        raise _bad("input must not be empty", "input")
    messages = conv.messages
    chat: dict = {"messages": messages}
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("instructions must be a string", "instructions")
        chat["messages"] = [{"role": "system", "content": instructions}, *messages]
    if body.get("model") is not None:
        chat["model"] = body["model"]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for k in ("temperature", "top_p", "parallel_tool_calls", "prompt_cache_key", *CHAT_EXTRAS):
        if body.get(k) is not None:
            chat[k] = body[k]
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise _bad("reasoning must be an object", "reasoning")
        for k in ("summary", "generate_summary"):
            if reasoning.get(k) is not None:
                raise _bad(f"reasoning.{k} is not supported: the reasoning comes whole, as reasoning_text")
        for k, neutral in REASONING_NEUTRAL.items():
            if reasoning.get(k) not in neutral:
                raise _bad(f"reasoning.{k} {reasoning[k]!r} is not supported by this server", f"reasoning.{k}")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    if body.get("text") is not None:
        fmt = _text_format(body["text"])
        if fmt is not None:
            chat["response_format"] = fmt
    stream = body.get("stream") is True
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    store = body.get("store") is not False
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise _bad("metadata must be an object", "metadata")
    return ResponsesRequest(body=body, chat=chat, messages=messages, stream=stream, store=store)
