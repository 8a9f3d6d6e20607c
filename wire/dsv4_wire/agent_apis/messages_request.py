"""An Anthropic Messages request (`POST /v1/messages`) as a chat-completions body. Pure.

What Claude Code sends is served: `system` (text or text blocks), `messages` (user, assistant,
and system ones mid-conversation, rendered where they stand as the model's format does) with
`text`, `tool_use`, `tool_result` and `thinking` blocks, `tools` with `input_schema`,
`tool_choice` (`auto`, `any`, `tool`, `none`, `disable_parallel_tool_use`), `thinking`
(enabled, its budget as an effort tier; adaptive or disabled), `max_tokens` (required, as Anthropic has it), `stop_sequences`,
`temperature`, `top_p`, `top_k`, `stream`, `metadata`, `output_config` (`effort`, a JSON-schema
`format`), `context_management` that keeps all thinking. `cache_control` marks (on blocks,
tools, or the request) are accepted: every prompt prefix is cached anyway; `user_profile_id`
and `workspace_id` name the caller and change nothing. What this server cannot honour (images
and documents, server tools such as web search, redacted thinking, an assistant prefill to
continue, MCP servers, containers, context-management edits that would clear something,
diagnostics, an inference region, fast mode, thinking between tools or with its display
omitted) is a 400 naming it; fields nobody defines are ignored, as on the chat route.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from dsv4_wire.errors import APIError

# Messages fields with no meaning here: a value other than the neutral one is refused.
NEUTRAL = {
    "mcp_servers": (None, []),
    "container": (None,),
    "diagnostics": (None,),  # a cache-miss report nothing here writes
    "inference_geo": (None,),
    "speed": (None, "standard"),
}
# Tool fields with no meaning here: a tool found by search (defer_loading), one called from
# code (allowed_callers), examples the model's format has no place for (input_examples).
# eager_input_streaming is a latency hint: calls are streamed whole once complete either way.
TOOL_NEUTRAL = {"defer_loading": (None, False), "allowed_callers": (None, ["direct"]), "input_examples": (None, [])}
# What a count_tokens body leaves out: it counts the prompt, and these change no prompt token.
GENERATION_FIELDS = (
    "max_tokens",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "stream",
    "metadata",
    "service_tier",
)


@dataclass
class MessagesRequest:
    body: dict
    chat: dict
    stream: bool = False


def _bad(message: str, param: Optional[str] = None) -> APIError:
    return APIError(message, 400, "invalid_request_error", param=param)


def _text_blocks(content: Any, where: str) -> str:
    """The text of a string or of text blocks (system prompts, tool results)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of text blocks", where)
    out = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise _bad(f"{where}[{i}]: block type {kind!r} is not supported here (only text)", where)
        out.append(block["text"])
    return "\n\n".join(out) if where == "system" else "".join(out)


def _user(msg: dict, where: str) -> list[dict]:
    """A user turn: its tool results (chat `tool` messages, in their order), then its text."""
    content = msg.get("content")
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of blocks", "messages")
    results, texts = [], []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise _bad(f"{where}.content[{i}]: a tool_result needs tool_use_id", "messages")
            if texts:
                raise _bad(f"{where}.content[{i}]: tool_result blocks come before the turn's text", "messages")
            text = _text_blocks(block.get("content", ""), f"{where}.content[{i}].content")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        else:
            raise _bad(f"{where}.content[{i}]: block type {kind!r} is not supported in a user turn", "messages")
    out = results
    if texts or not results:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant(msg: dict, where: str) -> dict:
    content = msg.get("content")
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of blocks", "messages")
    out: dict = {"role": "assistant", "content": None}
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            out["content"] = (out["content"] or "") + block["text"]
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            out["reasoning_content"] = out.get("reasoning_content", "") + block["thinking"]
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise _bad(f"{where}.content[{i}]: a tool_use needs id and name", "messages")
            args = block.get("input", {})
            if not isinstance(args, dict):
                raise _bad(f"{where}.content[{i}]: tool_use input must be an object", "messages")
            call = {
                "id": block["id"],
                "type": "function",
                "function": {"name": block["name"], "arguments": json.dumps(args)},
            }
            out.setdefault("tool_calls", []).append(call)
        else:
            raise _bad(f"{where}.content[{i}]: block type {kind!r} is not supported in an assistant turn", "messages")
    return out


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise _bad("tools must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") not in (None, "custom"):
            kind = t.get("type") if isinstance(t, dict) else None
            raise _bad(
                f"tools[{i}]: tool type {kind!r} is not supported (only client tools with input_schema)", "tools"
            )
        if not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema"), dict):
            raise _bad(f"tools[{i}]: a tool needs name and input_schema", "tools")
        for field, neutral in TOOL_NEUTRAL.items():
            if t.get(field) not in neutral:
                raise _bad(f"tools[{i}].{field} is not supported by this server", f"tools.{field}")
        fn = {"name": t["name"], "parameters": t["input_schema"]}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        if t.get("strict") is not None:
            fn["strict"] = t["strict"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any, chat: dict) -> None:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "none":
        chat["tool_choice"] = "none"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise _bad(f"tool_choice {choice!r} is not supported (auto, any, tool or none)", "tool_choice")
    if choice.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False


# thinking.budget_tokens onto the chat path's efforts (each checkpoint folds them onto its own
# tiers): a budget asks for a depth of thinking, as an effort does. Below 2048 tokens low, below
# 8192 medium, below 32768 high, else max. No budget is enforced beyond max_tokens.
BUDGET_EFFORTS = ((2048, "low"), (8192, "medium"), (32768, "high"))


def budget_effort(budget: int) -> str:
    return next((effort for bound, effort in BUDGET_EFFORTS if budget < bound), "max")


def _thinking(thinking: Any, max_tokens: int) -> bool:
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "disabled":
        return False
    if kind in ("adaptive", "enabled") and thinking.get("display") not in (None, "summarized"):
        raise _bad('thinking.display "omitted" is not supported: the thinking comes whole', "thinking.display")
    if kind == "adaptive":
        return True
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or not 1 <= budget < max_tokens:
            raise _bad("thinking.budget_tokens must be an integer below max_tokens", "thinking.budget_tokens")
        return True
    raise _bad(f"thinking {thinking!r} is not supported (enabled, adaptive or disabled)", "thinking")


def _context_management(cm: Any) -> None:
    """Only the edit that changes nothing is served: keep every thinking block (Claude Code sends
    it). What a turn re-renders of earlier reasoning is the model format's rule, as on the chat
    path; clearing tool results or thinking is the client's to do (send less)."""
    edits = cm.get("edits") if isinstance(cm, dict) else None
    if not isinstance(edits, list) or set(cm) - {"edits"}:
        raise _bad('context_management must be {"edits": [...]}', "context_management")
    for i, edit in enumerate(edits):
        if not (isinstance(edit, dict) and edit.get("type") == "clear_thinking_20251015" and edit.get("keep") == "all"):
            raise _bad(
                f"context_management.edits[{i}] is not supported (only clear_thinking keeping all)",
                "context_management",
            )


def _output_config(config: Any, chat: dict) -> None:
    """output_config: `effort` as the chat path's reasoning_effort, `format` as a JSON-schema
    response_format."""
    if not isinstance(config, dict):
        raise _bad("output_config must be an object", "output_config")
    unknown = sorted(set(config) - {"effort", "format"})
    if unknown:
        raise _bad(f"output_config.{unknown[0]} is not supported", "output_config")
    if config.get("effort") is not None:
        chat["reasoning_effort"] = config["effort"]
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise _bad('output_config.format must be {"type": "json_schema", "schema": {...}}', "output_config.format")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def messages_to_chat(body: Any, counting: bool = False) -> MessagesRequest:
    """`counting`: a count_tokens body (the prompt's fields only: no max_tokens is needed, and
    the generation fields, which change no prompt token, are not read)."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    for name, allowed in NEUTRAL.items():
        if body.get(name) not in allowed:
            raise _bad(f"{name} is not supported by this server", name)
    if counting:
        body = {k: v for k, v in body.items() if k not in GENERATION_FIELDS}
        body["max_tokens"] = 1 << 30  # no bound on a thinking budget either
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise _bad("max_tokens is required: a positive integer", "max_tokens")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages must be a non-empty list", "messages")
    chat_msgs: list[dict] = []
    if body.get("system") is not None:
        chat_msgs.append({"role": "system", "content": _text_blocks(body["system"], "system")})
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            chat_msgs += _user(m, where)
        elif role == "assistant":
            chat_msgs.append(_assistant(m, where))
        elif role == "system":  # a system message mid-conversation (Claude Code sends them): rendered where it is
            chat_msgs.append({"role": "system", "content": _text_blocks(m.get("content"), f"{where}.content")})
        else:
            raise _bad(f"{where}: role {role!r} is not supported (user, assistant or system)", "messages")
    if msgs[-1].get("role") == "assistant":
        raise _bad("a final assistant message (a prefill to continue) is not supported", "messages")
    chat: dict = {"messages": chat_msgs, "max_tokens": max_tokens}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    for k in ("temperature", "top_p", "top_k"):
        if body.get(k) is not None:
            chat[k] = body[k]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _bad("stop_sequences must be a list of strings", "stop_sequences")
        if stops:
            chat["stop"] = stops
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], chat)
    if body.get("thinking") is not None:
        chat["chat_template_kwargs"] = {"thinking": _thinking(body["thinking"], max_tokens)}
        if body["thinking"].get("type") == "enabled":  # output_config.effort, when given, wins
            chat["reasoning_effort"] = budget_effort(body["thinking"]["budget_tokens"])
    if body.get("context_management") is not None:
        _context_management(body["context_management"])
    if body.get("output_config") is not None:
        _output_config(body["output_config"], chat)
    if body.get("service_tier") not in (None, "auto", "standard_only"):
        raise _bad(f"service_tier {body['service_tier']!r} is not supported", "service_tier")
    if counting:
        del chat["max_tokens"]
    stream = body.get("stream") is True
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return MessagesRequest(body=body, chat=chat, stream=stream)
