"""Chat for DeepSeek models: rendering per family, tool-call and reasoning parsers, and the
tool-call grammar. Pure functions: the HTTP server calls them, they do no I/O (and import no
torch; `grammar` imports xgrammar, which does, so only the engine side imports it)."""

from dsv4_serve.chat.registry import ChatSetup, default_setup, tool_parser, with_overrides
from dsv4_serve.chat.pieces import ChatOptions, Rendered, RenderError
from dsv4_serve.chat.render import render

__all__ = [
    "ChatOptions",
    "ChatSetup",
    "RenderError",
    "Rendered",
    "default_setup",
    "render",
    "tool_parser",
    "with_overrides",
]
