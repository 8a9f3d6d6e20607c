"""Names -> renderers and parsers, and the defaults a checkpoint implies.

Parser names follow SGLang's and vLLM's spellings: `deepseekv31`, `deepseek_v31` and
`deepseek-v31` name the same parser.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dsv4_wire import chat_tokens as T
from dsv4_wire.chat_names import canonical
from dsv4_serve.chat.tool_parsers import (
    DeepSeekV3Parser,
    DeepSeekV4Parser,
    DeepSeekV31Parser,
    DeepSeekV32Parser,
    ToolParser,
)

TOOL_PARSERS = {
    "deepseek_v3": DeepSeekV3Parser,
    "deepseek_v31": DeepSeekV31Parser,
    "deepseek_v32": DeepSeekV32Parser,
    "deepseek_v4": DeepSeekV4Parser,
}
# deepseek_r1: the output always starts in reasoning; the others: when the prompt opened <think>.
REASONING_PARSERS = ("deepseek_r1", "deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4")
RENDERERS = ("deepseek_v31", "deepseek_v32", "deepseek_v4", "jinja")


def tool_parser(name: str) -> ToolParser:
    cls = TOOL_PARSERS.get(canonical(name))
    if cls is None:
        raise ValueError(
            f"unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_PARSERS)} "
            "(SGLang's and vLLM's spellings are accepted)"
        )
    return cls()


def reasoning_parser_name(name: str) -> str:
    n = canonical(name)
    if n not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of deepseek-r1, deepseek-v3, deepseek-v4")
    return n


@dataclass(frozen=True)
class ChatSetup:
    """How one engine renders chats and reads its model's output."""

    renderer: str  # one of RENDERERS
    template: Optional[str]  # the Jinja template when renderer == "jinja"
    tool_parser: Optional[str]
    reasoning_parser: Optional[str]
    effort_profile: Optional[str] = None  # reasoning_effort's tiers (chat/effort.py); None: the template's


def default_setup(
    model_type: Optional[str], vocab: set[str] | dict, template: Optional[str], builtin_template: Optional[str] = None
) -> ChatSetup:
    """The checkpoint's own format. `builtin_template`: the plain DeepSeek template that our older
    tiny checkpoints carry (rendered with the V3.1 renderer when the vocabulary has its tokens)."""
    if model_type == "deepseek_v4":
        return ChatSetup("deepseek_v4", None, "deepseek_v4", "deepseek_v4", "v4")
    if model_type == "deepseek_v32":
        return ChatSetup("deepseek_v32", None, "deepseek_v32", "deepseek_v32", "thinking")
    has_v31_tokens = T.TOOL_SEP in vocab and T.THINK_END in vocab
    if (
        model_type == "deepseek_v3"
        and has_v31_tokens
        and (template is None or template == builtin_template or T.THINK_END in template)
    ):
        return ChatSetup("deepseek_v31", None, "deepseek_v31", "deepseek_v31", "thinking")
    tools = "deepseek_v3" if model_type == "deepseek_v3" and T.TOOL_SEP in vocab else None
    reasoning = "deepseek_r1" if template and T.THINK_START in template else None
    return ChatSetup("jinja", template, tools, reasoning)


def with_overrides(
    setup: ChatSetup,
    chat_template: Optional[str] = None,
    tool_parser_name: Optional[str] = None,
    reasoning_parser_name_: Optional[str] = None,
) -> ChatSetup:
    """`--chat-template` (a Jinja file's text), `--tool-call-parser`, `--reasoning-parser`."""
    renderer, template = ("jinja", chat_template) if chat_template is not None else (setup.renderer, setup.template)
    tools = setup.tool_parser if tool_parser_name is None else tool_parser(tool_parser_name).name
    reasoning = (
        setup.reasoning_parser if reasoning_parser_name_ is None else reasoning_parser_name(reasoning_parser_name_)
    )
    effort = None if chat_template is not None else setup.effort_profile
    return ChatSetup(renderer, template, tools, reasoning, effort)
