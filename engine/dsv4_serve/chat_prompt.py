"""A chat request's prompt as the engine sees it: the request's messages and tools rendered in
the checkpoint's chat format, then tokenized. The engine's serving path and the router's
placement (`PromptIds`) share it, so the router scores the very ids the engine will cache."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Optional

from dsv4_engine.tokenizer import Tokenizer
from dsv4_serve.chat import ChatOptions, ChatSetup, default_setup, render, with_overrides
from dsv4_serve.chat.effort import profile_declared
from dsv4_serve.chat.pieces import Rendered
from dsv4_serve.protocol import ChatCompletionRequest, CompletionRequest
from dsv4_wire import APIError


def chat_setup(
    model_dir: str,
    tokenizer: Tokenizer,
    chat_template: Optional[str] = None,
    tool_call_parser: Optional[str] = None,
    reasoning_parser: Optional[str] = None,
) -> ChatSetup:
    """The checkpoint's chat format (model_type, vocabulary, template), then the flags."""
    from dsv4_engine.tokenizer import CHAT_TEMPLATE

    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        config = {}
    model_type = config.get("model_type") if isinstance(config, dict) else None
    setup = default_setup(
        model_type, tokenizer.backend.get_vocab(with_added_tokens=True), tokenizer.chat_template, CHAT_TEMPLATE
    )
    if setup.effort_profile == "v4":  # V4's tiers changed with its encoder: the checkpoint's own
        setup = replace(setup, effort_profile=profile_declared(model_dir, config))
    template = None
    if chat_template is not None:
        with open(chat_template, encoding="utf-8") as f:
            template = f.read()
    return with_overrides(setup, template, tool_call_parser, reasoning_parser)


def longest_token_chars(tokenizer: Tokenizer) -> int:
    """No token spells more characters than its longest vocabulary entry: a text longer than
    that times the context cannot fit, and is refused without spending seconds tokenising it."""
    return max(len(k) for k in tokenizer.backend.get_vocab(with_added_tokens=True))


def chat_tools(req: ChatCompletionRequest) -> list[dict]:
    """The tools the prompt announces (none when the client said tool_choice "none")."""
    return [t.model_dump(exclude_none=True) for t in req.tools or []] if req.tool_choice != "none" else []


def render_chat(
    setup: ChatSetup, tokenizer: Tokenizer, req: ChatCompletionRequest, max_model_len: int, max_token_chars: int
) -> tuple[Rendered, list[int]]:
    """The rendered chat prompt and its token ids; an APIError (400) for what cannot be one."""
    tools = chat_tools(req)
    opts = ChatOptions(
        tools=tools or None,
        thinking=req.thinking(),
        reasoning_effort=req.reasoning_effort,
        effort_profile=setup.effort_profile,
        add_generation_prompt=req.add_generation_prompt,
        template_kwargs=dict(req.chat_template_kwargs or {}),
    )
    msgs = [m.as_dict() for m in req.messages]
    chars = sum(len(m.get("content") or "") for m in msgs) + len(json.dumps(tools))
    if chars > max_model_len * max_token_chars:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, your messages "
            f"have at least {chars // max_token_chars} tokens ({chars} characters).",
            param="messages",
            code="context_length_exceeded",
        )
    try:
        rendered = render(
            setup.renderer,
            setup.template,
            msgs,
            opts,
            tokenizer.bos_token or "",
            tokenizer.eos_token or "",
            tokenizer.added_tokens,
        )
    except Exception as e:  # the format or template refused these messages (roles, order, ...)
        raise APIError(f"messages could not be rendered by the chat template: {e}", param="messages") from None
    ids = tokenizer.encode_pieces(rendered.pieces)
    if not ids:
        raise APIError("the rendered chat prompt is empty", param="messages")
    return rendered, ids


class PromptIds:
    """The router's tokenizer (`dsv4 router --tokenizer DIR`): a request body's prompt as token
    ids, rendered and tokenized as an engine serving DIR would, or None where the request is
    not one the engine would accept (the engine, not the router, answers it with the 400).
    Without it the router scores only prompts sent as token ids."""

    def __init__(self, model_dir: str, chat_template: Optional[str] = None, max_model_len: int = 1 << 20):
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.setup = chat_setup(model_dir, self.tokenizer, chat_template)
        self.max_model_len = max_model_len
        self.max_token_chars = longest_token_chars(self.tokenizer)

    def __call__(self, path: str, body: dict) -> Optional[list[int]]:
        try:
            if "chat" in path:
                req = ChatCompletionRequest.model_validate(body)
                return render_chat(self.setup, self.tokenizer, req, self.max_model_len, self.max_token_chars)[1]
            req = CompletionRequest.model_validate(body)
        except (ValueError, APIError):  # pydantic's ValidationError is a ValueError
            return None
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]  # a batch: its first prompt steers the placement
        if isinstance(prompt, str) and prompt and len(prompt) <= self.max_model_len * self.max_token_chars:
            return self.tokenizer.encode(prompt, add_bos=True)
        return None
