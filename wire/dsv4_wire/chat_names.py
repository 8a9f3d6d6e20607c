"""Names of DeepSeek's chat formats, shared by the HTTP process (which picks the parser) and the
engine (which builds the tool-call grammar of that format)."""

from __future__ import annotations

import re

# The tool-call formats we parse and constrain (SGLang's and vLLM's parser names, canonical form).
TOOL_CALL_FORMATS = ("deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4")


def canonical(name: str) -> str:
    """`deepseekv31`, `DeepSeek-V31`, `deepseek_v31` -> `deepseek_v31`."""
    n = name.strip().lower().replace("-", "_")
    return re.sub(r"^deepseek_?(v\d+|r1)$", r"deepseek_\1", n)
