"""A chat request's `tool_choice` -> the constraint its answer is sampled under (pure).

`required` and a named function: only the model's native tool-call text. `auto` (the default
with tools): free text, then at most one well-formed call block — unless the server runs the
raw model (`--disable-auto-tool-grammar`) or the request has an output constraint of its own
(`response_format`, `structured_outputs`, `guided_*`), which then wins. `none`: nothing.
"""

from __future__ import annotations

from typing import Optional, Union

from dsv4_engine.structured.spec import StructuredSpec, tool_calls
from dsv4_wire import APIError


def tool_choice_spec(
    tool_parser: Optional[str],
    tools: list[dict],
    tool_choice: Union[str, dict, None],
    parallel_tool_calls: bool,
    thinking: bool,
    other_constraints: list[str],
    auto_grammar: bool = True,
) -> Optional[StructuredSpec]:
    """The spec, or None for an unconstrained answer; an APIError (400 naming `tool_choice`) for
    a forced choice that cannot be served. `tool_choice` is "auto"/"none"/"required"/None or a
    named function as a dict; `other_constraints`: the request's other constraint fields."""
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    if forced:
        what = '"required"' if tool_choice == "required" else "a named function"
        if other_constraints:
            raise APIError(
                f"tool_choice {what} constrains the output to tool calls; it cannot be combined "
                f"with {', '.join(other_constraints)}",
                param="tool_choice",
            )
        if not tool_parser:
            raise APIError(
                f"tool_choice {what} needs a tool-call format, and this model has none "
                "(start the server with --tool-call-parser)",
                param="tool_choice",
            )
    elif not (tools and tool_choice in (None, "auto") and tool_parser and auto_grammar and not other_constraints):
        return None
    try:
        return tool_calls(tool_parser, tools, tool_choice if forced else "auto", parallel_tool_calls, thinking)
    except ValueError as e:
        raise APIError(str(e), param="tool_choice") from None
